"""Check `tessera checkpoint export --to peft` and `--to hf --merge` with the reference implementation.

Loads the base model (the HF folder the LoRA run started from with `--init-from`) with
transformers' AutoModelForCausalLM, applies the PEFT export with peft's own
PeftModel.from_pretrained, and compares its logits with Tessera's forward of the LoRA checkpoint
(`tessera checkpoint logits`, the runtime's layers with their adapters, on one rank). The merged
export (`--to hf --merge`) is loaded with transformers alone and compared the same way. A
difference is max |reference - tessera| / max |tessera| over the batch (scripts/check_hf_export.py);
each must be within --tolerance (1e-4).

The adapters must matter: the base alone must differ from Tessera's forward by at least
--min-effect (relative, as above), or a round trip that dropped them would pass. PEFT's loaded
adapter state must be the file's, key for key and value for value (no key ignored or missing).

    python scripts/check_peft_export.py --tessera target/release/tessera \
        --checkpoint LORA_CK --base BASE_HF --peft PEFT_DIR --merged MERGED_HF

Prints one JSON line; exits 1 on any problem.
"""

import argparse
import json
import sys

from check_hf_export import compare, load_hf, tessera_logits, token_ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", required=True, help="the tessera binary")
    ap.add_argument("--checkpoint", required=True, help="the LoRA checkpoint that was exported")
    ap.add_argument("--base", required=True, help="the base model's HF folder (the run's --init-from)")
    ap.add_argument("--peft", required=True, help="the `--to peft` folder")
    ap.add_argument("--merged", required=True, help="the `--to hf --merge` folder")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--min-effect", type=float, default=1e-2)
    args = ap.parse_args()

    import peft
    import torch
    import transformers
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    problems = []
    base, config = load_hf(args.base, problems)
    ids = token_ids(config["vocab_size"], args.batch, args.seq_len)
    batch = torch.tensor(ids, dtype=torch.long)
    ours = tessera_logits(args.tessera, args.checkpoint, ids)
    with torch.no_grad():
        base_logits = base(batch).logits.to(torch.float64)
    effect, _ = compare(base_logits, ours, float("inf"), "base", problems)
    if not effect >= args.min_effect:
        problems.append(f"the adapters change the logits by {effect:.3e} < {args.min_effect:.0e}: too little to tell a round trip that drops them")

    model = PeftModel.from_pretrained(base, args.peft)
    model.eval()
    saved = load_file(f"{args.peft}/adapter_model.safetensors")
    loaded = get_peft_model_state_dict(model)
    if sorted(saved) != sorted(loaded):
        problems.append(f"peft's adapter keys {sorted(loaded)} are not the file's {sorted(saved)}")
    else:
        for key, value in saved.items():
            if not torch.equal(value, loaded[key].to(value.dtype)):
                problems.append(f"peft loaded {key} with other values than the file's")
    with torch.no_grad():
        peft_logits = model(batch).logits.to(torch.float64)
    peft_rel, peft_abs = compare(peft_logits, ours, args.tolerance, "peft", problems)

    merged, _ = load_hf(args.merged, problems)
    with torch.no_grad():
        merged_logits = merged(batch).logits.to(torch.float64)
    merged_rel, merged_abs = compare(merged_logits, ours, args.tolerance, "merged", problems)

    print(json.dumps({
        "peft": args.peft,
        "merged": args.merged,
        "class": type(base).__name__,
        "transformers": transformers.__version__,
        "peft_version": peft.__version__,
        "torch": torch.__version__,
        "tokens": [args.batch, args.seq_len],
        "adapter_effect_rel": effect,
        "peft_max_rel_diff": peft_rel,
        "peft_max_abs_diff": peft_abs,
        "merged_max_rel_diff": merged_rel,
        "merged_max_abs_diff": merged_abs,
        "ok": not problems,
        "problems": problems,
    }))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
