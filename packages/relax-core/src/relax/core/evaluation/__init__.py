"""Held-out evaluation: pass@k / mean@k / maj@k estimators, eval metrics and completion files, the
``eval`` section's checks and the training-sample log. The loop that runs it is ``controller.evaluator``."""
