"""Bench room: `fantai bench throughput | latency | serve | plot` (see fantai.bench.cli)."""
