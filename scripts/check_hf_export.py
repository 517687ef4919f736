"""Check a `tessera checkpoint export --to hf` folder with the reference implementation.

Loads the exported folder with Hugging Face transformers (AutoModelForCausalLM.from_pretrained,
CPU, float32, eager attention), runs it on a fixed batch of token ids, and compares its logits
with Tessera's forward of the checkpoint it was exported from (`tessera checkpoint logits`, the
runtime's own layers on one rank). The difference is max |hf - tessera| / max |tessera| over the
whole batch (relative to the logits' scale: element-wise ratios blow up where a logit is near
zero); it must be within --tolerance (1e-4).

    python scripts/check_hf_export.py --tessera target/release/tessera \
        --checkpoint CK_DIR --export HF_DIR [--batch 2] [--seq-len 16]

Prints one JSON line (class, tokens, max_rel_diff, max_abs_diff); exits 1 when the logits differ,
the class is not the one config.json names, or transformers reports a missing, unexpected or
mis-shaped weight.
"""

import argparse
import json
import subprocess
import sys


def token_ids(vocab, batch, seq_len):
    """A fixed batch: a small LCG, so the ids do not depend on any library's RNG."""
    state, rows = 12345, []
    for _ in range(batch):
        row = []
        for _ in range(seq_len):
            state = (1103515245 * state + 12345) % (1 << 31)
            row.append(state % vocab)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", required=True, help="the tessera binary")
    ap.add_argument("--checkpoint", required=True, help="the checkpoint that was exported")
    ap.add_argument("--export", required=True, help="the exported HF folder")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with open(f"{args.export}/config.json") as f:
        config = json.load(f)
    vocab = config["vocab_size"]
    ids = token_ids(vocab, args.batch, args.seq_len)

    model, info = AutoModelForCausalLM.from_pretrained(
        args.export,
        dtype=torch.float32,
        attn_implementation="eager",
        output_loading_info=True,
    )
    model.eval()
    problems = []
    if type(model).__name__ != config["architectures"][0]:
        problems.append(f"loaded {type(model).__name__}, config names {config['architectures'][0]}")
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            problems.append(f"{key}: {sorted(map(str, info[key]))}")
    with torch.no_grad():
        hf = model(torch.tensor(ids, dtype=torch.long)).logits.to(torch.float64)

    flat = ",".join(str(t) for row in ids for t in row)
    out = subprocess.run(
        [args.tessera, "checkpoint", "logits", args.checkpoint, "--tokens", flat,
         "--seq-len", str(args.seq_len)],
        check=True, capture_output=True, text=True,
    )
    ours = torch.tensor(json.loads(out.stdout)["logits"], dtype=torch.float64)
    ours = ours.reshape(args.batch, args.seq_len, vocab)
    if ours.shape != hf.shape:
        problems.append(f"logits shape: tessera {tuple(ours.shape)}, transformers {tuple(hf.shape)}")
        abs_diff = rel_diff = float("inf")
    else:
        abs_diff = (hf - ours).abs().max().item()
        rel_diff = abs_diff / ours.abs().max().item()
    if not rel_diff <= args.tolerance:
        problems.append(f"max relative logit difference {rel_diff:.3e} > {args.tolerance:.0e}")
    print(json.dumps({
        "export": args.export,
        "class": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokens": [args.batch, args.seq_len],
        "max_rel_diff": rel_diff,
        "max_abs_diff": abs_diff,
        "ok": not problems,
        "problems": problems,
    }))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
