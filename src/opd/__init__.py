"""opd: on-policy distillation of large language models.

Layers (data flows one way): data → models → rollout / teacher → objectives → train → eval / report.
The math lives in `opd.objectives` as pure tensor functions; see SPEC.md for what each computes.
"""

__version__ = "0.1.0"
