"""`python -m bench.device --call CALL` (bench.device.__main__): what a lent accelerator measures,
as independent calls of at most 9 minutes, each leaving an archive and a summary: the calls' steps
and their limits (bench.device.plan) and the summary's rows in words (bench.device.summary)."""
