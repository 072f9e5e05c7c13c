//! Profiling: one Job per cost table lacking a valid SPS(B) table, pinned to the pool's node
//! type, running `dspark-engine profile --compact --output /dev/termination-log`. The table
//! comes back in the container's termination message; it is validated and stored in the
//! `DSparkCostTable` status. A failed Job backs off exponentially (no Job storm) and the
//! engines keep their default table.
//!
//! The state machine ([`next_step`]) is pure; [`advance`] does the I/O.

use dspark_types::contract::flags::{self, arg};
use std::collections::BTreeMap;

use dspark_types::CostTable;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{Container, Pod, PodTemplateSpec, Volume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Resource, ResourceExt};

use super::names::{
    COMPONENT_PROFILER, LABEL_COMPONENT, LABEL_COST_TABLE, LABEL_MANAGED_BY, MANAGER,
};
use super::pool::{
    container_security, model_plan, pod_spec_base, pod_template_meta, resources, MODEL_CACHE_DIR,
};
use crate::crd::{
    CostTableKey, CostTablePhase, DSparkCostTable, DSparkCostTableStatus, DSparkDeployment,
    NodePool,
};
use crate::{Error, Result};

/// Name of the profiling container.
pub const PROFILE_CONTAINER: &str = "profile";

/// Name of the profiling Job of attempt (`revision`, `failures`) of a cost table: a new name
/// per attempt, so an attempt is never run twice and a finished Job is never reused.
pub fn job_name(cost_table: &str, revision: i64, failures: i32) -> String {
    format!("{cost_table}-p{revision}-{failures}")
}

/// The profiling Job for `pool`'s cost table `ct` (owned by the cost table, so deleting the
/// table deletes its Jobs).
pub fn profiling_job(
    dsd: &DSparkDeployment,
    pool: &NodePool,
    ct: &DSparkCostTable,
    name: &str,
) -> Job {
    let plan = model_plan(dsd, pool);
    let mut args = vec![
        "profile".to_string(),
        arg(flags::MODEL),
        plan.model.clone(),
        arg(flags::OUTPUT),
        "/dev/termination-log".into(),
        arg(flags::COMPACT),
        arg(flags::NODE_TYPE),
        pool.node_type.clone(),
    ];
    // With a drafter, the table also carries its time per draft call (`draft_points`),
    // which the dspark policy prices drafting with.
    if let Some(d) = &plan.drafter {
        args.extend([arg(flags::DRAFTER), d.clone()]);
    }
    if plan.remote {
        args.extend([arg(flags::CACHE), MODEL_CACHE_DIR.into()]);
    }
    args.extend(dsd.spec.profiling.args.iter().cloned());
    let volumes: Vec<Volume> = plan.volumes.clone();
    let mounts = plan.mounts.clone();
    let mut env = plan.env.clone();
    env.extend(dsd.spec.engine.env.iter().cloned());
    let container = Container {
        name: PROFILE_CONTAINER.into(),
        image: Some(dsd.spec.engine.image_for(pool)),
        image_pull_policy: dsd.spec.engine.image_pull_policy.clone(),
        command: Some(vec!["dspark-engine".into()]),
        args: Some(args),
        env: (!env.is_empty()).then_some(env),
        env_from: (!plan.env_from.is_empty()).then(|| plan.env_from.clone()),
        resources: Some(resources(dsd, pool)),
        termination_message_path: Some("/dev/termination-log".into()),
        termination_message_policy: Some("File".into()),
        security_context: Some(container_security()),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let labels = BTreeMap::from([
        (LABEL_COST_TABLE.to_string(), ct.name_any()),
        (LABEL_COMPONENT.to_string(), COMPONENT_PROFILER.to_string()),
        (LABEL_MANAGED_BY.to_string(), MANAGER.to_string()),
    ]);
    let mut pod = pod_spec_base(dsd, pool, vec![container], volumes);
    pod.restart_policy = Some("Never".into());
    pod.init_containers = (!plan.init_containers.is_empty()).then_some(plan.init_containers);
    Job {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: ct.namespace(),
            labels: Some(labels.clone()),
            owner_references: ct.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            active_deadline_seconds: Some(dsd.spec.profiling.timeout_seconds),
            ttl_seconds_after_finished: Some(86_400),
            template: PodTemplateSpec {
                metadata: Some(pod_template_meta(dsd, labels)),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// How a Job ended, if it did.
#[derive(Debug, Clone, PartialEq)]
pub enum JobOutcome {
    Running,
    Succeeded,
    Failed(String),
}

/// Reads a Job's status.
pub fn job_outcome(job: &Job) -> JobOutcome {
    let Some(status) = &job.status else {
        return JobOutcome::Running;
    };
    for c in status.conditions.iter().flatten() {
        if c.status != "True" {
            continue;
        }
        match c.type_.as_str() {
            "Complete" | "SuccessCriteriaMet" => return JobOutcome::Succeeded,
            "Failed" | "FailureTarget" => {
                let why = [c.reason.as_deref(), c.message.as_deref()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(": ");
                return JobOutcome::Failed(if why.is_empty() {
                    "Job failed".into()
                } else {
                    why
                });
            }
            _ => {}
        }
    }
    if status.succeeded.unwrap_or(0) > 0 {
        JobOutcome::Succeeded
    } else if status.failed.unwrap_or(0) > 0 {
        JobOutcome::Failed("the profiling pod failed".into())
    } else {
        JobOutcome::Running
    }
}

/// The termination message of the profiling container of `pod`, if it has terminated.
pub fn termination_message(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == PROFILE_CONTAINER)?
        .state
        .as_ref()?
        .terminated
        .as_ref()?
        .message
        .clone()
        .filter(|m| !m.trim().is_empty())
}

/// Validates a table read back from a profiling Job: well-formed, monotone, and measured on
/// the node type it is keyed by (when the table names one).
pub fn validate_table(text: &str, key: &CostTableKey, source: &str) -> Result<CostTable> {
    let table = CostTable::from_json(text).map_err(|error| Error::CostTable {
        source_name: source.into(),
        error,
    })?;
    if let Some(nt) = &table.node_type {
        if nt != &key.node_type {
            return Err(Error::CostTable {
                source_name: source.into(),
                error: dspark_types::CostTableError::WrongDevice {
                    table: nt.clone(),
                    engine: key.node_type.clone(),
                },
            });
        }
    }
    Ok(table)
}

/// Seconds to wait after the `failures`-th consecutive failure: `base * 2^(failures-1)`,
/// capped at `max`.
pub fn retry_delay(failures: i32, base: i64, max: i64) -> i64 {
    let shift = (failures.max(1) - 1).min(30) as u32;
    base.saturating_mul(1i64 << shift).min(max)
}

/// What to do next for a cost table.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A valid table is stored (or profiling is disabled): nothing to do.
    Idle,
    /// Create the Job of this name.
    Start(String),
    /// Look at the Job of this name.
    Watch(String),
    /// Failed: wait until this time before the next attempt.
    Wait(Timestamp),
}

/// The pure state machine of a cost table.
pub fn next_step(
    ct_name: &str,
    status: &DSparkCostTableStatus,
    enabled: bool,
    now: Timestamp,
) -> Step {
    match status.phase {
        CostTablePhase::Ready if status.table.is_some() => Step::Idle,
        _ if !enabled => Step::Idle,
        CostTablePhase::Profiling => match &status.job {
            Some(job) => Step::Watch(job.clone()),
            None => Step::Start(job_name(ct_name, status.revision, status.failures)),
        },
        CostTablePhase::Failed => {
            let retry = status
                .retry_after
                .as_deref()
                .and_then(|t| t.parse::<Timestamp>().ok());
            match retry {
                Some(t) if t > now => Step::Wait(t),
                _ => Step::Start(job_name(ct_name, status.revision, status.failures)),
            }
        }
        _ => Step::Start(job_name(ct_name, status.revision, status.failures)),
    }
}

/// The status after an attempt ended: a stored table, or a failure with its backoff.
pub fn after_attempt(
    status: &DSparkCostTableStatus,
    result: std::result::Result<CostTable, String>,
    now: Timestamp,
    retry_base: i64,
    retry_max: i64,
) -> DSparkCostTableStatus {
    let mut s = status.clone();
    match result {
        Ok(table) => {
            s.phase = CostTablePhase::Ready;
            s.revision += 1;
            s.digest = Some(table.digest());
            s.measured_at = Some(table.measured_at.clone());
            s.table = Some(table);
            s.failures = 0;
            s.retry_after = None;
            s.message = None;
        }
        Err(why) => {
            s.phase = CostTablePhase::Failed;
            s.failures += 1;
            let delay = retry_delay(s.failures, retry_base, retry_max);
            s.retry_after = Some(rfc3339(now + SignedDuration::from_secs(delay)));
            s.message = Some(why);
        }
    }
    s
}

/// RFC 3339 with second precision.
pub fn rfc3339(t: Timestamp) -> String {
    Timestamp::from_second(t.as_second())
        .unwrap_or(t)
        .to_string()
}

/// What happened in one [`advance`], for events.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    Nothing,
    Started(String),
    Stored {
        revision: i64,
        job: String,
    },
    Failed {
        job: String,
        why: String,
        retry_after: String,
    },
}

/// Moves a cost table's profiling one step: starts a Job, or reads a finished one and stores
/// its table (or the failure). Returns the new status (already written) and what happened.
pub async fn advance(
    client: &kube::Client,
    cached_jobs: &kube::runtime::reflector::Store<Job>,
    dsd: &DSparkDeployment,
    pool: &NodePool,
    key: &CostTableKey,
    ct: &DSparkCostTable,
    now: Timestamp,
) -> Result<(DSparkCostTableStatus, Progress)> {
    let ns = ct
        .namespace()
        .ok_or_else(|| Error::NoNamespace(ct.name_any()))?;
    let status = ct.status.clone().unwrap_or_default();
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let p = &dsd.spec.profiling;
    let (new, progress) = match next_step(&ct.name_any(), &status, p.enabled, now) {
        Step::Idle | Step::Wait(_) => return Ok((status, Progress::Nothing)),
        Step::Start(name) => {
            let job = profiling_job(dsd, pool, ct, &name);
            match jobs.create(&PostParams::default(), &job).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
            let mut s = status.clone();
            s.phase = CostTablePhase::Profiling;
            s.job = Some(name.clone());
            (s, Progress::Started(name))
        }
        Step::Watch(name) => {
            // The watch cache, or the API server when the Job is not cached (yet, or gone).
            let cached = cached_jobs
                .get(&kube::runtime::reflector::ObjectRef::new(&name).within(&ns))
                .map(|j| (*j).clone());
            let found = match cached {
                Some(j) => Some(j),
                None => jobs.get_opt(&name).await?,
            };
            let outcome = match found {
                None => JobOutcome::Failed(format!("profiling Job {name} disappeared")),
                Some(job) => job_outcome(&job),
            };
            let result = match outcome {
                JobOutcome::Running => return Ok((status, Progress::Nothing)),
                JobOutcome::Failed(why) => Err(why),
                JobOutcome::Succeeded => read_table(client, &ns, &name, key).await,
            };
            let s = after_attempt(
                &status,
                result,
                now,
                p.retry_base_seconds,
                p.retry_max_seconds,
            );
            let progress = match (&s.phase, &s.message) {
                (CostTablePhase::Ready, _) => Progress::Stored {
                    revision: s.revision,
                    job: name,
                },
                (_, why) => Progress::Failed {
                    job: name,
                    why: why.clone().unwrap_or_default(),
                    retry_after: s.retry_after.clone().unwrap_or_default(),
                },
            };
            (s, progress)
        }
    };
    if new != status {
        write_status(client, &ns, &ct.name_any(), &new).await?;
    }
    Ok((new, progress))
}

async fn read_table(
    client: &kube::Client,
    ns: &str,
    job: &str,
    key: &CostTableKey,
) -> std::result::Result<CostTable, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&format!("job-name={job}")))
        .await
        .map_err(|e| format!("listing the pods of Job {job}: {e}"))?;
    let message = list
        .items
        .iter()
        .find_map(termination_message)
        .ok_or_else(|| format!("Job {job} succeeded but its pod has no termination message; does the image's `dspark-engine profile` support --compact --output?"))?;
    validate_table(&message, key, &format!("Job {job}")).map_err(|e| e.to_string())
}

/// Writes a cost table's status with server-side apply.
pub async fn write_status(
    client: &kube::Client,
    ns: &str,
    name: &str,
    status: &DSparkCostTableStatus,
) -> Result<()> {
    let api: Api<DSparkCostTable> = Api::namespaced(client.clone(), ns);
    let patch = serde_json::json!({
        "apiVersion": DSparkCostTable::api_version(&()),
        "kind": DSparkCostTable::kind(&()),
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::cost_table_name;
    use crate::reconcile::pool::tests::sample;
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStatus, PodStatus,
    };

    fn now() -> Timestamp {
        "2026-11-29T10:00:00Z".parse().unwrap()
    }

    fn table_json(node: &str) -> String {
        format!(
            r#"{{"schema":1,"model_id":"qwen3-8b","engine_version":"0.1.0","device":"NVIDIA A100","node_type":"{node}","dtype":"bf16","measured_at":"2026-11-29T09:00:00Z","points":[[1,100.0],[8,80.0],[64,20.0]]}}"#
        )
    }

    fn ct(dsd: &DSparkDeployment, pool: &NodePool) -> (CostTableKey, DSparkCostTable) {
        let key = dsd.cost_table_key(pool).unwrap();
        let mut ct = DSparkCostTable::new(&cost_table_name(&key), key.spec());
        ct.metadata.namespace = Some("ns".into());
        ct.metadata.uid = Some("ct-uid".into());
        (key, ct)
    }

    #[test]
    fn job_is_pinned_to_the_node_type_and_writes_the_termination_log() {
        let d = sample();
        let pool = &d.spec.pools[0];
        let (_, ct) = ct(&d, pool);
        let name = job_name(&ct.name_any(), 0, 0);
        assert!(name.len() <= 63, "{name}");
        let job = profiling_job(&d, pool, &ct, &name);
        assert_eq!(
            job.metadata.owner_references.as_ref().unwrap()[0].kind,
            "DSparkCostTable"
        );
        let spec = job.spec.unwrap();
        assert_eq!(spec.backoff_limit, Some(0));
        assert_eq!(spec.active_deadline_seconds, Some(1200));
        let pod = spec.template.spec.unwrap();
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            pod.node_selector.unwrap()["dspark.dev/node-type"],
            "h100-80gb"
        );
        assert_eq!(pod.tolerations.unwrap().len(), 1);
        let c = &pod.containers[0];
        assert_eq!(
            c.args.as_ref().unwrap().join(" "),
            "profile --model /models/model/qwen3-8b --output /dev/termination-log --compact --node-type h100-80gb --drafter /models/drafter/qwen3-8b-dspark-b7"
        );
        // The drafter is mounted like the model (read-only), so the table gets its
        // draft times.
        let mounts: Vec<&str> = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .map(|m| m.mount_path.as_str())
            .collect();
        assert_eq!(mounts, ["/models/model", "/models/drafter"]);
        assert_eq!(pod.volumes.as_ref().unwrap().len(), 2);
        assert_eq!(
            c.resources.as_ref().unwrap().limits.as_ref().unwrap()["nvidia.com/gpu"].0,
            "1"
        );
        assert_eq!(c.termination_message_policy.as_deref(), Some("File"));
    }

    #[test]
    fn state_machine_starts_watches_backs_off_and_stops() {
        let mut s = DSparkCostTableStatus::default();
        assert_eq!(
            next_step("ct", &s, true, now()),
            Step::Start("ct-p0-0".into())
        );
        assert_eq!(next_step("ct", &s, false, now()), Step::Idle);
        s.phase = CostTablePhase::Profiling;
        s.job = Some("ct-p0-0".into());
        assert_eq!(
            next_step("ct", &s, true, now()),
            Step::Watch("ct-p0-0".into())
        );
        // First failure: wait the base delay, then a new Job name.
        let failed = after_attempt(&s, Err("OOMKilled".into()), now(), 60, 3600);
        assert_eq!(failed.phase, CostTablePhase::Failed);
        assert_eq!(failed.failures, 1);
        assert_eq!(failed.retry_after.as_deref(), Some("2026-11-29T10:01:00Z"));
        assert!(matches!(
            next_step("ct", &failed, true, now()),
            Step::Wait(_)
        ));
        let later = now() + SignedDuration::from_secs(61);
        assert_eq!(
            next_step("ct", &failed, true, later),
            Step::Start("ct-p0-1".into())
        );
        // Repeated failures double the wait, capped.
        let mut f = failed.clone();
        for _ in 0..10 {
            f = after_attempt(&f, Err("x".into()), now(), 60, 3600);
        }
        assert_eq!(f.retry_after.as_deref(), Some("2026-11-29T11:00:00Z"));
        // Success stores the table and resets the failures.
        let table = CostTable::from_json(&table_json("h100-80gb")).unwrap();
        let ok = after_attempt(&f, Ok(table.clone()), now(), 60, 3600);
        assert_eq!(
            (ok.phase, ok.revision, ok.failures),
            (CostTablePhase::Ready, 1, 0)
        );
        assert_eq!(ok.digest.as_deref(), Some(table.digest().as_str()));
        assert_eq!(next_step("ct", &ok, true, now()), Step::Idle);
        assert_eq!(retry_delay(1, 60, 3600), 60);
        assert_eq!(retry_delay(3, 60, 3600), 240);
        assert_eq!(retry_delay(40, 60, 3600), 3600);
    }

    #[test]
    fn tables_are_validated_against_the_key() {
        let d = sample();
        let (key, _) = ct(&d, &d.spec.pools[0]);
        assert!(validate_table(&table_json("h100-80gb"), &key, "Job j").is_ok());
        let e = validate_table(&table_json("a100-80gb"), &key, "Job j").unwrap_err();
        assert!(e.to_string().contains("a100-80gb"), "{e}");
        let e = validate_table("{\"schema\":1", &key, "Job j").unwrap_err();
        assert!(e.to_string().contains("Job j"), "{e}");
    }

    #[test]
    fn job_outcomes_and_termination_messages() {
        let mut job = Job::default();
        assert_eq!(job_outcome(&job), JobOutcome::Running);
        job.status = Some(JobStatus {
            conditions: Some(vec![JobCondition {
                type_: "Failed".into(),
                status: "True".into(),
                reason: Some("DeadlineExceeded".into()),
                message: Some("Job was active longer than specified deadline".into()),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert_eq!(
            job_outcome(&job),
            JobOutcome::Failed(
                "DeadlineExceeded: Job was active longer than specified deadline".into()
            )
        );
        job.status = Some(JobStatus {
            succeeded: Some(1),
            ..Default::default()
        });
        assert_eq!(job_outcome(&job), JobOutcome::Succeeded);
        let pod = Pod {
            status: Some(PodStatus {
                container_statuses: Some(vec![ContainerStatus {
                    name: PROFILE_CONTAINER.into(),
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            exit_code: 0,
                            message: Some(table_json("h100-80gb")),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(termination_message(&pod), Some(table_json("h100-80gb")));
        assert_eq!(termination_message(&Pod::default()), None);
    }
}
