"""`tessera export --to sbatch` scripts against their plans, without a Slurm controller.

Usage: python3 check_exports_sbatch.py [--results FILE] NAME PLAN.json SCRIPT [...] (standard
library only). For each script: `bash -n` must accept it; the #SBATCH options (as sbatch reads
them: the comment block before the first command, long or short forms) must request what the plan
needs, derived from plan.json: its nodes, one task per rank on each node (rank r on node
r // gpus_per_node) and a GPU per task, or for a CPU plan one task and no GPU of any kind; and
the script must start the ranks with `srun tessera run`. The same script with one GPU a node more
must fail this check (a check that cannot fail would show). `check-exports.sh sbatch` also asks a
real slurmctld (`sbatch --test-only`), by hand.
"""

import re
import shlex
import subprocess

from check_exports_common import compare, launch, run

SHORT = {"-N": "nodes", "-n": "ntasks", "-G": "gpus", "-J": "job-name", "-c": "cpus-per-task"}


def sbatch_options(text):
    """The options of the #SBATCH lines sbatch reads: those before the first line that is
    neither blank nor a comment (sbatch stops there)."""
    opts = {}
    for line in text.splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break
        if not s.startswith("#SBATCH"):
            continue
        words = shlex.split(s[len("#SBATCH"):], comments=True)
        i = 0
        while i < len(words):
            w = words[i]
            if w.startswith("--"):
                key, eq, value = w[2:].partition("=")
                if not eq:
                    value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else True
                    i += value is not True
            elif w in SHORT:
                key, value = SHORT[w], words[i + 1]
                i += 1
            else:
                raise AssertionError(f"an #SBATCH option this check does not know: {w}")
            assert key not in opts, f"--{key} given twice"
            opts[key] = value
            i += 1
    return opts


def gpus_per_node(opts):
    """GPUs asked of each node, from whichever option asks for them (None: none asked)."""
    asked = {k: v for k, v in opts.items() if k in ("gpus-per-node", "gpus-per-task", "gpus", "gres")}
    if not asked:
        return None
    assert len(asked) == 1, f"GPUs asked by several options: {asked}"
    (k, v), = asked.items()
    n = int(re.fullmatch(r"(?:gpu:)?(?:[\w-]+:)?(\d+)", v).group(1))
    if k == "gpus-per-task":
        return n * int(opts["ntasks-per-node"])
    if k == "gpus":
        return n // int(opts["nodes"])
    return n


def read(text):
    """What the script asks Slurm for."""
    o = sbatch_options(text)
    nodes = int(o.get("nodes", 1))
    ntasks = int(o["ntasks"]) if "ntasks" in o else nodes * int(o.get("ntasks-per-node", 1))
    per = int(o.get("ntasks-per-node", -(-ntasks // nodes)))
    assert ntasks == nodes * per, (
        f"--ntasks={ntasks} over {nodes} nodes of at most {per}: which node holds which rank is "
        "Slurm's choice, not stated by the script")
    return {"nodes": nodes, "tasks on each node": [per] * nodes, "GPUs per node": gpus_per_node(o)}


def check(name, plan, plan_path, path):
    text = open(path).read()
    subprocess.run(["bash", "-n", path], check=True)
    print("  bash -n: ok")
    L = launch(plan)
    want = {"nodes": L["nodes"], "tasks on each node": L["per_node"],
            "GPUs per node": L["per_node"][0] if L["gpus"] else None}
    got = read(text)
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    got["starts the ranks with"] = want["starts the ranks with"] = "srun tessera run"
    if not any(re.match(r"\s*srun\s+tessera\s+run\b", ln) for ln in lines):
        got["starts the ranks with"] = "no `srun tessera run` line"
    compare("sbatch", got, want)

    # The check can fail: one GPU a node more than the plan's is refused.
    if L["gpus"]:
        broken = re.sub(r"(--gpus-per-node=)(\d+)", lambda m: f"{m.group(1)}{int(m.group(2)) + 1}", text)
    else:
        broken = text.replace("#SBATCH --ntasks=1", "#SBATCH --ntasks=1\n#SBATCH --gpus-per-node=1")
    assert broken != text, "no variant made"
    try:
        refused = read(broken)["GPUs per node"] != want["GPUs per node"]
    except AssertionError:
        refused = True
    if not refused:
        raise AssertionError("this check accepted one GPU a node more")
    print("  one GPU a node more: refused")
    print(f"ok: the sbatch script of {name} asks for the plan's nodes, tasks and GPUs")


if __name__ == "__main__":
    run("sbatch", check)
