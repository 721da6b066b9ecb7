"""The `orchard` command (`main.py`), one module per subcommand, each exposing `register(subparsers)`:

    serve, head, join, status, drain, bench, demo_model; lifecycle.py holds what head and join share.

Heavy imports (MLX, Ray) happen inside the commands, so `orchard --help` stays fast.
"""
