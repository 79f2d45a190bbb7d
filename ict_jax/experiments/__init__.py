"""Experiments on top of training runs: the pre-registered experiment's runner with its plan, record,
statistics, report, status, branched arms, recovery, time box and provenance (``runner``, ``plan``,
``record``, ``stats``, ``report``, ``status``, ``branch``, ``recover``, ``box``, ``provenance``), and the
method comparison (``compare``, ``compare_report``). docs/experiments.md. The core (``rl``, ``model``,
``sampling``, ``data``, ``rewards``, ``train``) never imports it."""
