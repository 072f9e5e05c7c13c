//! Leader election on a `coordination.k8s.io/v1` Lease: of several operator replicas only the
//! holder reconciles. The decision ([`lease_action`]) is pure; writes use optimistic
//! concurrency (the Lease's resourceVersion), so two candidates never both win.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::PostParams;
use kube::Api;

use crate::reconcile::names::MANAGER;
use crate::Result;

/// What a candidate should do with the Lease it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAction {
    /// No Lease yet: create it, holding it.
    Create,
    /// We hold it: renew.
    Renew,
    /// Nobody holds it, or the holder stopped renewing: take it over.
    TakeOver,
    /// Someone else holds a live Lease.
    Wait,
}

/// Decides from the current Lease spec (`None`: no Lease).
pub fn lease_action(spec: Option<&LeaseSpec>, identity: &str, now: Timestamp) -> LeaseAction {
    let Some(spec) = spec else {
        return LeaseAction::Create;
    };
    match spec.holder_identity.as_deref() {
        Some(h) if h == identity => LeaseAction::Renew,
        None | Some("") => LeaseAction::TakeOver,
        Some(_) => {
            let duration =
                SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15)));
            let expired = spec
                .renew_time
                .as_ref()
                .or(spec.acquire_time.as_ref())
                .is_none_or(|t| t.0 + duration < now);
            if expired {
                LeaseAction::TakeOver
            } else {
                LeaseAction::Wait
            }
        }
    }
}

/// One candidate for one Lease.
pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaderElector {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.into(),
            identity: identity.into(),
            duration,
        }
    }

    /// How often a holder renews.
    pub fn renew_period(&self) -> Duration {
        self.duration / 3
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Acquires or renews the Lease; `Ok(true)` while this candidate holds it.
    pub async fn try_acquire_or_renew(&self) -> Result<bool> {
        let now = Timestamp::now();
        let current = self.api.get_opt(&self.name).await?;
        let action = lease_action(
            current.as_ref().and_then(|l| l.spec.as_ref()),
            &self.identity,
            now,
        );
        let pp = PostParams {
            field_manager: Some(MANAGER.into()),
            ..Default::default()
        };
        let mut spec = current
            .as_ref()
            .and_then(|l| l.spec.clone())
            .unwrap_or_default();
        spec.lease_duration_seconds = Some(self.duration.as_secs() as i32);
        spec.renew_time = Some(MicroTime(now));
        let result = match action {
            LeaseAction::Wait => return Ok(false),
            LeaseAction::Create => {
                spec.holder_identity = Some(self.identity.clone());
                spec.acquire_time = Some(MicroTime(now));
                spec.lease_transitions = Some(0);
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec),
                };
                self.api.create(&pp, &lease).await.map(|_| ())
            }
            LeaseAction::Renew | LeaseAction::TakeOver => {
                if action == LeaseAction::TakeOver {
                    spec.holder_identity = Some(self.identity.clone());
                    spec.acquire_time = Some(MicroTime(now));
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                let mut lease = current.expect("a Lease to renew or take over");
                lease.spec = Some(spec);
                self.api.replace(&self.name, &pp, &lease).await.map(|_| ())
            }
        };
        match result {
            Ok(()) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Gives the Lease up (on shutdown) so another replica takes over at once.
    pub async fn release(&self) -> Result<()> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        let pp = PostParams {
            field_manager: Some(MANAGER.into()),
            ..Default::default()
        };
        match self.api.replace(&self.name, &pp, &lease).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn spec(holder: Option<&str>, renewed: &str) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(Into::into),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(at(renewed))),
            ..Default::default()
        }
    }

    #[test]
    fn one_holder_at_a_time() {
        let now = at("2026-11-29T10:00:10Z");
        assert_eq!(lease_action(None, "a", now), LeaseAction::Create);
        let held = spec(Some("a"), "2026-11-29T10:00:00Z");
        assert_eq!(lease_action(Some(&held), "a", now), LeaseAction::Renew);
        assert_eq!(lease_action(Some(&held), "b", now), LeaseAction::Wait);
        // Expired: the holder stopped renewing 15 s ago.
        let later = at("2026-11-29T10:00:16Z");
        assert_eq!(lease_action(Some(&held), "b", later), LeaseAction::TakeOver);
        // Released.
        let free = spec(None, "2026-11-29T10:00:00Z");
        assert_eq!(lease_action(Some(&free), "b", now), LeaseAction::TakeOver);
    }
}
