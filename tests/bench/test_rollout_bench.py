"""The rollout throughput bench runs end to end and reports both backends on the same work."""

from bench import rollout


def test_rollout_bench_reports_both_backends(tmp_path):
  rows = rollout.run("tiny", repeats=1)
  assert {(r.backend, r.workload) for r in rows} == {(b, w) for b in ("paged", "dense") for w in ("fixed", "varied")}
  by = {(r.backend, r.workload): r for r in rows}
  for w in ("fixed", "varied"):
    assert by["paged", w].tokens == by["dense", w].tokens > 0  # same work, every request to its length
    assert by["paged", w].tokens_per_s > 0
  assert by["paged", "fixed"].tokens == 2 * 2 * 8
  assert "speedup vs dense" in rollout.markdown(rows)
  assert rollout.main(["--size", "tiny", "--repeats", "1", "--out", str(tmp_path)]) == 0
  assert (tmp_path / "results.json").exists() and (tmp_path / "summary.md").exists()
