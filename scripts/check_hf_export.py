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


def load_hf(folder, problems):
    """The transformers model in `folder` (CPU, float32, eager attention), in eval mode; what
    transformers reports missing, unexpected or mis-shaped, and a class other than the one
    config.json names, is appended to `problems`."""
    import torch
    from transformers import AutoModelForCausalLM

    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        attn_implementation="eager",
        output_loading_info=True,
    )
    model.eval()
    if type(model).__name__ != config["architectures"][0]:
        problems.append(f"loaded {type(model).__name__}, config names {config['architectures'][0]}")
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            problems.append(f"{folder}: {key}: {sorted(map(str, info[key]))}")
    return model, config


def tessera_logits(tessera, checkpoint, ids):
    """`tessera checkpoint logits` of the batch `ids` (rows of equal length), float64,
    shaped (batch, seq_len, vocab)."""
    import torch

    flat = ",".join(str(t) for row in ids for t in row)
    out = subprocess.run(
        [tessera, "checkpoint", "logits", checkpoint, "--tokens", flat,
         "--seq-len", str(len(ids[0]))],
        check=True, capture_output=True, text=True,
    )
    doc = json.loads(out.stdout)
    ours = torch.tensor(doc["logits"], dtype=torch.float64)
    return ours.reshape(len(ids), len(ids[0]), doc["vocab"])


def compare(reference, ours, tolerance, what, problems):
    """max |reference - ours| / max |ours| and max |reference - ours|; a difference above
    `tolerance` (or another shape) is appended to `problems`."""
    if ours.shape != reference.shape:
        problems.append(f"{what} logits shape: tessera {tuple(ours.shape)}, reference {tuple(reference.shape)}")
        return float("inf"), float("inf")
    abs_diff = (reference - ours).abs().max().item()
    rel_diff = abs_diff / ours.abs().max().item()
    if not rel_diff <= tolerance:
        problems.append(f"{what}: max relative logit difference {rel_diff:.3e} > {tolerance:.0e}")
    return rel_diff, abs_diff


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

    problems = []
    model, config = load_hf(args.export, problems)
    ids = token_ids(config["vocab_size"], args.batch, args.seq_len)
    with torch.no_grad():
        hf = model(torch.tensor(ids, dtype=torch.long)).logits.to(torch.float64)
    ours = tessera_logits(args.tessera, args.checkpoint, ids)
    rel_diff, abs_diff = compare(hf, ours, args.tolerance, "transformers", problems)
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
