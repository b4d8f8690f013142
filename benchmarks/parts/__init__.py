"""What the scripts of benchmarks/ run, as modules; none of them is run on its own.

- ``calib_sample``, ``ov_profile``, ``ptq_spread``: the subcommands of ``benchmarks/diagnose.py``;
- ``ddp``: ``benchmarks/cost.py --mode ddp``;
- ``custom_model``: ``benchmarks/cli_results.py custom-model``;
- ``portable``: the command and paths a result set records, written so that anyone can run them.
"""
