"""Ahead-of-time compilation and capacity planning: a run's programs compiled for a TPU slice or the local
devices with nothing run (``compile``), their text and JSON reports (``report``), the search for the
cheapest settings that fit (``fit``) and reading the compiled HLO (``hlo``). docs/tpu.md."""
