"""Diagnostics of a model or a checkpoint: the paper's token diagnostics (``diagnose`` with its
``diagnose_measures``, ``diagnose_advantage`` and ``diagnose_report``), the token inspector (``inspector``,
``inspector_page``) and each selector's gradient against the dense one (``gradient_alignment``).
docs/results.md, docs/inspector.md. The core (``rl``, ``model``, ``sampling``, ``data``, ``rewards``,
``train``) never imports it."""
