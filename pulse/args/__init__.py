"""Command-line arguments defined once, for `pulse` and for the processes it starts.

`pulse train` starts torchrun or msrun workers, and `pulse export` / `cache-latents`
start a PyTorch child; each child parses the same flags its parent wrote. Defining
them here, below ``pulse.cli``, lets the backends' entries read them without
importing the CLI::

    parser      argument types (one line per bad value, exit 2) and OneLineParser
    model_args  --diffusers-config, --pipeline, --model-option KEY=VALUE
    run_args    the training flags (`pulse train` and every rank entry)
    tools       export / cache-latents flags, and how a tool child runs
"""
