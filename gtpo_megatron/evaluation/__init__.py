"""Evaluation: pass@k / maj@k with vLLM (``gtpo-eval``) and training-curve comparison (``gtpo-compare``).

Public API: ``evaluation.metrics`` (``pass_at_k``, ``maj_at_k``, ``aggregate``), ``evaluation.evaluate``
(``EvalConfig``, ``run_evaluation``), ``evaluation.compare`` (``load_metrics``, ``compare_runs``). Importing this
package imports neither vLLM nor matplotlib.
"""
