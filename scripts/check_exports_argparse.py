"""What the Megatron-LM and Megatron-DeepSpeed checks share: an argument parser must refuse a
misspelt flag, so that a check of our flags can fail."""

import contextlib
import io
import sys


def refuses_misspelt(parse_args, ours):
    """Runs `parse_args(ignore_unknown_args=False)` on `ours` plus `--sequence-paralel`; exits
    the check unless the parser refuses it (argparse exits 2 after printing its usage)."""
    sys.argv = ["pretrain_gpt.py", *ours, "--sequence-paralel"]
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:  # argparse's usage, long
            parse_args(ignore_unknown_args=False)
    except SystemExit as e:
        print(f"  refused (exit {e.code}): {err.getvalue().splitlines()[-1]}")
    else:
        sys.exit("parse_args accepted --sequence-paralel")
