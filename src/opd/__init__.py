"""opd: on-policy distillation of large language models.

The package is layered, bottom to top (docs/design.md, "Layers"): records, I/O, seeds and config; the components
(data, models, scoring, rollout engines, teacher scorers, objectives, eval); train; check; one recipe per command in
`opd.recipes`; the CLI. A module imports only from its own layer or below.
The math lives in `opd.objectives` as pure tensor functions; docs/spec.md says what each computes (the sources'
`SPEC §N` are its sections).
"""

__version__ = "0.1.0"
