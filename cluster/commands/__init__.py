"""One module per `orchard` subcommand, each exposing `register(subparsers)`."""
