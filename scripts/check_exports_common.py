"""What the engine checks share: a plan's numbers derived from plan.json alone (never from an
export's text), and the loop that checks several exports in one process and records each result.

Every check script takes `[--results FILE] NAME PLAN.json EXPORT ...` (triples) and checks each
export against its plan; a failure of one export is printed and recorded, and the next one is
checked. The script exits 1 if any failed. With --results, one line per export is appended:
`NAME<TAB>TARGET<TAB>ok|FAIL<TAB>detail` (scripts/check-exports.sh matrix reads it).
"""

import json
import sys
import traceback


def load(path):
    with open(path) as f:
        return json.load(f)


def chunks(plan):
    """The plan's model chunks in pipeline order (virtual stage = chunk · PP + stage; under zb-v
    chunk 1 of stage s holds piece 2·PP − 1 − s, the V of planner/src/schedule/mod.rs), each as
    (stage, chunk, first layer, end layer, embedding, head)."""
    pp = plan["parallel"]["pp"]
    v_shape = plan["parallel"]["schedule"] == "zb-v"
    out = []
    for s in plan["stages"]:
        for c in s["chunks"]:
            piece = 2 * pp - 1 - s["stage"] if v_shape and c["chunk"] == 1 else c["chunk"] * pp + s["stage"]
            assert c["virtual_stage"] == piece, c
            out.append((c["virtual_stage"], s["stage"], c["chunk"], c["layers"][0], c["layers"][1],
                        c.get("embedding", False), c.get("head", False)))
    out.sort()
    starts = [c[3] for c in out]
    ends = [c[4] for c in out]
    layers = plan["job"]["model"]["architecture"]["layers"]
    assert starts[0] == 0 and ends[-1] == layers and starts[1:] == ends[:-1], "chunks not contiguous"
    return [c[1:] for c in out]


def recomputed_layers(plan):
    """The layers (0-based) whose activations the plan recomputes in full: every layer with full
    recompute, layers N, 2N, … counting from 1 with recompute_every N (docs/plan.md), none
    otherwise (selective recompute is per op, inside every layer)."""
    p = plan["parallel"]
    if p["recompute"] != "full":
        return set()
    every = p.get("recompute_every") or 1
    layers = plan["job"]["model"]["architecture"]["layers"]
    return {j for j in range(layers) if (j + 1) % every == 0}


def launch(plan):
    """What a launcher must start for the plan, from its world size and cluster alone: for a GPU
    plan, rank r on node r // gpus_per_node (docs/plan.md, parallel.mesh_order), so
    ceil(world / gpus_per_node) nodes holding min(gpus_per_node, the ranks left) ranks each, a GPU
    per rank; for a CPU plan one process on one node, its ranks threads (README, `tessera run`:
    the CPU backend runs threads as ranks), and no GPUs."""
    c = plan["job"]["cluster"]
    world = plan["parallel"]["world"]
    if c["device"]["kind"] == "cpu":
        return {"gpus": False, "nodes": 1, "per_node": [1], "world": world}
    gpn = c["gpus_per_node"]
    nodes = -(-world // gpn)
    per_node = [min(gpn, world - n * gpn) for n in range(nodes)]
    return {"gpus": True, "nodes": nodes, "per_node": per_node, "world": world}


def offload_devices(zc):
    """(optimizer, param) offload devices as DeepSpeed's DeepSpeedZeroConfig `zc` reads them,
    "none" where a section is absent."""
    dev = lambda section: str(getattr(section.device, "value", section.device)) if section else "none"  # noqa: E731
    return dev(zc.offload_optimizer), dev(zc.offload_param)


def want_offload(plan):
    """(optimizer, param) offload devices the plan asks for: `parallel.offload` (absent: none)
    to `parallel.offload_to` (absent: cpu)."""
    p = plan["parallel"]
    off, to = p.get("offload", "none"), p.get("offload_to", "cpu")
    return (to if off != "none" else "none"), (to if off == "params" else "none")


def short(v):
    """A long list as runs: [8, 8, 8, 4] is "[8]*3 + [4]", [0, 1, …, 31] is "[0..31]"."""
    if not isinstance(v, list) or len(v) <= 8:
        return repr(v)
    if all(isinstance(x, int) for x in v) and v == list(range(v[0], v[0] + len(v))):
        return f"[{v[0]}..{v[-1]}]"
    runs = []
    for x in v:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return " + ".join(f"[{x!r}]*{n}" if n > 1 else f"[{x!r}]" for x, n in runs)


def compare(engine, got, want):
    """Prints each value as the engine read it beside the plan's; fails on any difference."""
    bad = []
    for k in want:
        mark = "" if got.get(k) == want[k] else "   <-- differs"
        print(f"  {k}: {engine} read {short(got.get(k))}, plan {short(want[k])}{mark}")
        if mark:
            bad.append(k)
    assert not bad, f"{engine}'s reading differs from the plan: {', '.join(bad)}"


def run(target, check):
    """Runs `check(name, plan, plan_path, export_path)` for every triple on the command line."""
    argv = sys.argv[1:]
    results = None
    if argv[:1] == ["--results"]:
        results, argv = argv[1], argv[2:]
    if not argv or len(argv) % 3:
        sys.exit(f"usage: {sys.argv[0]} [--results FILE] NAME PLAN.json EXPORT [NAME PLAN.json EXPORT ...]")
    failed = 0
    for i in range(0, len(argv), 3):
        name, plan_path, export_path = argv[i:i + 3]
        print(f"== {name} -> {target}: {export_path}", flush=True)
        try:
            check(name, load(plan_path), plan_path, export_path)
            status, detail = "ok", ""
        except (Exception, SystemExit) as e:  # one export's failure must not hide the others'
            failed += 1
            detail = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
            if not isinstance(e, (AssertionError, SystemExit)):
                traceback.print_exc(file=sys.stdout)
            print(f"FAIL {name} -> {target}: {detail}")
            status = "FAIL"
        sys.stdout.flush()
        if results:
            with open(results, "a") as f:
                f.write(f"{name}\t{target}\t{status}\t{detail}\n")
    sys.exit(1 if failed else 0)
