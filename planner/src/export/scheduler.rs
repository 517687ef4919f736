//! Scheduler files that start `tessera` itself: a Slurm batch script (one task per rank) and a
//! Kubernetes indexed Job (one pod per node, each running `tessera launch`), with the
//! processes, nodes and GPUs of [`Launch`].

use serde_yaml_ng::{Mapping, Value};

use super::{comment_text, dns_name, refuse, ExportError, Launch, Target};
use crate::plan::Plan;

/// The port the ranks meet at (the launcher's default).
const MASTER_PORT: u64 = 29500;

/// A plan whose last node holds fewer ranks than the others cannot be started by launchers
/// that run the same number of processes on every node.
fn uniform(target: Target, launch: &Launch) -> Result<u64, ExportError> {
    launch.uniform().ok_or_else(|| {
        refuse(
            target,
            format!(
                "{} ranks on {} ({} starts the same number of ranks on every node, and the plan places rank r on node r / {})",
                launch.world,
                launch.describe(),
                match target {
                    Target::Sbatch => "this script",
                    _ => "tessera launch",
                },
                launch.per_node[0]
            ),
            format!(
                "re-plan with --devices a multiple of {} (or at most one node)",
                launch.per_node[0]
            ),
        )
    })
}

fn header(kind: &str, plan: &Plan, launch: &Launch) -> String {
    let p = &plan.parallel;
    format!(
        "# {kind} for {} on {} devices (dp {} × tp {} × pp {}), written by tessera export.\n\
         # It starts {}.\n",
        comment_text(&plan.job.model.name),
        p.world,
        p.dp,
        p.tp,
        p.pp,
        launch.describe()
    )
}

/// A Slurm batch script: one task per GPU, each a `tessera run` rank (it reads Slurm's
/// variables and meets the others at the first node); a CPU plan is one task.
pub(super) fn sbatch(plan: &Plan, launch: &Launch) -> Result<String, ExportError> {
    let job = format!("tessera-{}", dns_name(&plan.job.model.name));
    let mut directives: Vec<String> = vec![format!("--job-name={job}")];
    let body = if launch.gpus {
        let per = uniform(Target::Sbatch, launch)?;
        directives.extend([
            format!("--nodes={}", launch.nodes),
            format!("--ntasks={}", launch.world),
            format!("--ntasks-per-node={per}"),
            format!("--gpus-per-node={per}"),
            "--exclusive".into(),
        ]);
        format!(
            "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n\
             export MASTER_PORT=${{MASTER_PORT:-{MASTER_PORT}}}\n\
             # One task per rank; each reads SLURM_PROCID / SLURM_NTASKS (docs/cuda.md, \"Launching\").\n"
        )
    } else {
        directives.extend([
            "--nodes=1".to_string(),
            "--ntasks=1".into(),
            "--exclusive".into(),
        ]);
        format!(
            "# One task: the CPU backend trains the plan's {} ranks as threads of one process.\n",
            launch.world
        )
    };
    let mut out = String::from("#!/bin/bash\n");
    out += &header("Slurm batch script", plan, launch);
    for d in directives {
        out += &format!("#SBATCH {d}\n");
    }
    out += "set -euo pipefail\n";
    out += &body;
    out += "srun tessera run \"${PLAN:-plan.json}\" \"$@\"\n";
    Ok(out)
}

fn map<const N: usize>(pairs: [(&str, Value); N]) -> Value {
    let mut m = Mapping::new();
    for (k, v) in pairs {
        m.insert(Value::String(k.into()), v);
    }
    Value::Mapping(m)
}

fn s(v: impl Into<String>) -> Value {
    Value::String(v.into())
}

fn n(v: u64) -> Value {
    Value::Number(v.into())
}

fn list<const N: usize>(items: [Value; N]) -> Value {
    Value::Sequence(items.into())
}

/// A Kubernetes indexed Job (one pod per node) and the headless Service that gives pod 0 the
/// name the others meet at; each pod runs `tessera launch` for its node. The container command
/// is an argument list (no shell): Kubernetes substitutes `$(JOB_COMPLETION_INDEX)`. Several
/// nodes need the same `TESSERA_JOB_TOKEN` on every pod: it comes from a Secret the header
/// says how to create. A CPU plan is one pod running `tessera run`, with no GPUs.
pub(super) fn kubernetes(plan: &Plan, launch: &Launch) -> Result<String, ExportError> {
    let name = format!("tessera-{}", dns_name(&plan.job.model.name));
    let plan_volume = map([
        ("name", s("plan")),
        ("configMap", map([("name", s(format!("{name}-plan")))])),
    ]);
    let mounts = list([map([("name", s("plan")), ("mountPath", s("/plan"))])]);
    let mut text = header("Kubernetes manifest", plan, launch);
    text += &format!(
        "# The plan is mounted from the ConfigMap {name}-plan (kubectl create configmap {name}-plan --from-file=plan.json).\n"
    );
    let mut docs: Vec<Value> = Vec::new();
    let (container, pods) = if launch.gpus {
        let per = uniform(Target::Kubernetes, launch)?;
        let nodes = launch.nodes.to_string();
        let per_s = per.to_string();
        let master = format!("{name}-0.{name}");
        let port = MASTER_PORT.to_string();
        let command: Vec<Value> = [
            "tessera",
            "launch",
            "/plan/plan.json",
            "--nnodes",
            &nodes,
            "--nproc",
            &per_s,
            "--node-rank",
            "$(JOB_COMPLETION_INDEX)",
            "--master-addr",
            &master,
            "--master-port",
            &port,
        ]
        .into_iter()
        .map(s)
        .collect();
        let mut c = Mapping::new();
        c.insert(s("name"), s("tessera"));
        c.insert(s("image"), s("tessera:latest"));
        c.insert(s("command"), Value::Sequence(command));
        if launch.nodes > 1 {
            text += &format!(
                "# The nodes' ranks check one job token, from the Secret {name}-token (kubectl create secret generic {name}-token --from-literal=token=$(openssl rand -hex 16)).\n"
            );
            c.insert(
                s("env"),
                list([map([
                    ("name", s("TESSERA_JOB_TOKEN")),
                    (
                        "valueFrom",
                        map([(
                            "secretKeyRef",
                            map([("name", s(format!("{name}-token"))), ("key", s("token"))]),
                        )]),
                    ),
                ])]),
            );
        }
        c.insert(
            s("resources"),
            map([("limits", map([("nvidia.com/gpu", n(per))]))]),
        );
        c.insert(s("volumeMounts"), mounts);
        docs.push(map([
            ("apiVersion", s("v1")),
            ("kind", s("Service")),
            ("metadata", map([("name", s(&name))])),
            (
                "spec",
                map([
                    ("clusterIP", s("None")),
                    ("selector", map([("job-name", s(&name))])),
                ]),
            ),
        ]));
        (Value::Mapping(c), launch.nodes)
    } else {
        let c = map([
            ("name", s("tessera")),
            ("image", s("tessera:latest")),
            (
                "command",
                list([s("tessera"), s("run"), s("/plan/plan.json")]),
            ),
            ("volumeMounts", mounts),
        ]);
        (c, 1)
    };
    let mut pod_spec = Mapping::new();
    if launch.gpus {
        pod_spec.insert(s("subdomain"), s(&name));
    }
    pod_spec.insert(s("restartPolicy"), s("Never"));
    pod_spec.insert(s("containers"), list([container]));
    pod_spec.insert(s("volumes"), list([plan_volume]));
    docs.push(map([
        ("apiVersion", s("batch/v1")),
        ("kind", s("Job")),
        ("metadata", map([("name", s(&name))])),
        (
            "spec",
            map([
                ("completionMode", s("Indexed")),
                ("completions", n(pods)),
                ("parallelism", n(pods)),
                ("backoffLimit", n(0)),
                ("template", map([("spec", Value::Mapping(pod_spec))])),
            ]),
        ),
    ]));
    for (i, doc) in docs.iter().enumerate() {
        if i > 0 {
            text += "---\n";
        }
        text += &serde_yaml_ng::to_string(doc).expect("a YAML value serialises");
    }
    Ok(text)
}
