"""The benchmark harness: kernel-vs-reference parity and timing, roofline fractions, reports."""
