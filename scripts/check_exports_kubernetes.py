"""`tessera export --to kubernetes` manifests: Kubernetes' own schemas, and the plan's numbers.

Usage: python3 check_exports_kubernetes.py [--results FILE] NAME PLAN.json MANIFEST [...] with
kubernetes-validate (and its PyYAML) importable. For each manifest: `kubernetes-validate --strict
-k 1.37.0` (the Kubernetes 1.37.0 OpenAPI schemas, offline; an unknown field is an error) must
accept it and refuse it with `completionMode` misspelt; and what it starts must be the plan's,
derived from plan.json: one pod per node the plan uses (an indexed Job), on each
`tessera launch` with the node's ranks (rank r on node r // gpus_per_node), its index as node
rank and pod 0 of the Job's headless Service as master, and the node's GPUs as
`nvidia.com/gpu`; for a CPU plan one pod and no GPUs. With several pods, TESSERA_JOB_TOKEN is set
in the pod template (so every pod of the Job has it) from one source: a Secret or a literal, not
a per-pod field.
"""

import subprocess
import sys
import tempfile

import yaml

from check_exports_common import compare, launch, run

VERSION = "1.37.0"


def validate(path):
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", VERSION, "--quiet", path],
                          capture_output=True, text=True)


def option(command, flag):
    return command[command.index(flag) + 1] if flag in command else None


def check(name, plan, plan_path, path):
    r = validate(path)
    assert r.returncode == 0, f"kubernetes-validate --strict: {(r.stdout + r.stderr).strip()}"
    print(f"  kubernetes-validate --strict -k {VERSION}: ok")
    text = open(path).read()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as broken:
        broken.write(text.replace("completionMode:", "completionMod:"))
        broken.flush()
        assert validate(broken.name).returncode != 0, "kubernetes-validate accepted completionMod"
    print("  completionMode misspelt: refused")

    docs = [d for d in yaml.safe_load_all(text) if d]
    jobs = [d for d in docs if d["kind"] == "Job"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert len(jobs) == 1, f"{len(jobs)} Jobs"
    job = jobs[0]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    command = container.get("command", []) + container.get("args", [])
    limits = container.get("resources", {}).get("limits", {})
    requests = container.get("resources", {}).get("requests", {})
    gpus = {limits.get("nvidia.com/gpu"), requests.get("nvidia.com/gpu")} - {None}
    L = launch(plan)
    pods = spec.get("completions", 1)
    got = {
        "pods": pods,
        "pods at once": spec.get("parallelism", 1),
        "GPUs per pod": gpus.pop() if len(gpus) == 1 else (sorted(gpus) or None),
        "GPU resources elsewhere": sorted(k for k in {**limits, **requests} if "gpu" in k and k != "nvidia.com/gpu"),
    }
    want = {
        "pods": L["nodes"],
        "pods at once": L["nodes"],
        "GPUs per pod": L["per_node"][0] if L["gpus"] else None,
        "GPU resources elsewhere": [],
    }
    if command[:2] == ["tessera", "launch"]:
        nproc = option(command, "--nproc")
        got.update({
            "program": "tessera launch",
            "--nnodes": int(option(command, "--nnodes") or 1),
            "ranks on each node": [int(nproc)] * pods if nproc else None,
        })
        want.update({"program": "tessera launch", "--nnodes": L["nodes"], "ranks on each node": L["per_node"]})
        if pods > 1:
            svc = [s for s in services if s["metadata"]["name"] == pod.get("subdomain")]
            got.update({
                "completionMode": spec.get("completionMode"),
                "--node-rank": option(command, "--node-rank"),
                "--master-addr": option(command, "--master-addr"),
                "headless Service selecting the Job's pods": bool(svc) and svc[0]["spec"].get("clusterIP") == "None"
                and svc[0]["spec"].get("selector") == {"job-name": job["metadata"]["name"]},
            })
            want.update({
                "completionMode": "Indexed",
                "--node-rank": "$(JOB_COMPLETION_INDEX)",
                "--master-addr": f"{job['metadata']['name']}-0.{pod.get('subdomain')}",
                "headless Service selecting the Job's pods": True,
            })
    else:
        got["program"] = " ".join(command[:2])
        want["program"] = "tessera launch" if L["gpus"] else "tessera run"
        got["ranks on each node"] = want["ranks on each node"] = None
    if pods > 1 or L["nodes"] > 1:
        env = {e["name"]: e for e in container.get("env", [])}
        token = env.get("TESSERA_JOB_TOKEN")
        source = None
        if token and token.get("value"):
            source = "a literal"
        elif token and "secretKeyRef" in token.get("valueFrom", {}):
            source = "a Secret"
        got["TESSERA_JOB_TOKEN, one value for every pod"] = source or ("a per-pod field" if token else "not set")
        want["TESSERA_JOB_TOKEN, one value for every pod"] = got["TESSERA_JOB_TOKEN, one value for every pod"] \
            if source else "a Secret or a literal"
    compare("kubernetes", got, want)
    print(f"ok: the Kubernetes manifest of {name} starts the plan's pods, ranks and GPUs")


if __name__ == "__main__":
    run("kubernetes", check)
