//! Leader election and the leader's singleton duties: publishing the assignment (in this
//! process's sharding mode: a change of mode revokes every bucket first), collecting
//! abandoned member Leases, and the program's own ([`LeaderDuties`]: bucket labels in label
//! mode, as [`super::namespace_labels`] puts them on namespaces).
//!
//! The leader is elected with kube-leader-election's `LeaseLock`, with the incarnation as
//! holder. That library can let two candidates believe they won for a moment, so nothing
//! here relies on a single leader:
//! - publishing the assignment is a write with a resourceVersion precondition, so a stale
//!   or second leader's write fails instead of overwriting;
//! - a bucket leaves its owner only through a revocation that the owner acknowledged, or
//!   that has aged past what the owner can still do (see `sharding::assignment`), so a
//!   wrong view of who is alive costs time, never safety;
//! - labelling an object with its bucket writes the same value whoever does it.
//!
//! A leader plans only from a member view that is listed and current: the member watch has
//! shown its own Lease renewed within a renew deadline. While it is not, the leader gives the
//! leader Lease up and does not campaign, so that a member whose watch works leads instead.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use kube_leader_election::{LeaseLock, LeaseLockParams, LeaseLockResult};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::census::Census;
use super::epoch_floor::EpochFloor;
use super::members::{Members, lease_state};
use super::metrics as m;
use super::ownership::Ownership;
use super::published::AssignmentView;
use super::{Replica, ShardConfig};
use crate::assignment::{
    Assignment, DrainFacts, Slot, may_reassign, must_republish, starting_point, track_revocations,
};
use crate::balance::{self, Steadiness};
use crate::bucket::Mode;
use crate::capacity;
use crate::counts::Counts;
use crate::hash_ranges::{Ranges, by_hash};
use crate::membership::{Liveness, pod_of};
use crate::planning::{self, Inputs, Plan};

/// A member Lease unchanged for this many lease durations is left over from a pod that is
/// gone (scaled in, renamed), and the leader deletes it.
const ABANDONED_AFTER_LEASES: u32 = 20;

/// What a program's leader does beside publishing the assignment, while it leads.
pub trait LeaderDuties: Send + Sync + 'static {
    /// Started when this replica becomes the leader, in its sharding mode; `stop` is
    /// cancelled when it stops leading, and the future should then end soon.
    fn lead(&self, mode: Mode, stop: CancellationToken) -> Option<BoxFuture<'static, ()>>;

    /// After this replica stopped leading: resets what the duties report.
    fn stopped(&self) {}
}

/// A leader with no duties beyond the assignment.
pub struct NoDuties;

impl LeaderDuties for NoDuties {
    fn lead(&self, _: Mode, _: CancellationToken) -> Option<BoxFuture<'static, ()>> {
        None
    }
}

/// This replica's candidacy, and its duties while it leads.
pub struct Leader {
    duties: Arc<dyn LeaderDuties>,
    lock: LeaseLock,
    config: ShardConfig,
    ownership: Arc<Ownership>,
    members: Arc<Members>,
    view: Arc<AssignmentView>,
    /// Where generations are reserved before they are published.
    floor: EpochFloor,
    configmaps: Api<ConfigMap>,
    leases: Api<Lease>,
    /// When we first knew each revoking generation was written: its revocations' clock.
    known_since: Mutex<BTreeMap<u64, Instant>>,
    /// (incarnation, revoking generation) pairs that a quorum read found silent.
    confirmed_silent: Mutex<BTreeSet<(String, u64)>>,
    /// When we last planned, for the unowned-time counter.
    last_planned: Mutex<Option<Instant>>,
    /// Whether the object counts the replicas report have held still.
    steadiness: Mutex<Steadiness>,
    /// The renewing members given nothing, as last logged.
    idle_logged: Mutex<BTreeMap<String, String>>,
    /// Our own count of every bucket's objects, while members advertise capacities.
    census: Arc<Census>,
    /// The (seen, known) generations of the last loss logged.
    loss_logged: Mutex<(u64, u64)>,
}

impl Leader {
    /// Campaigns with `client`, which should be exempt from any client-side rate limit.
    pub fn new(client: Client, replica: &Replica, members: Arc<Members>, duties: Arc<dyn LeaderDuties>) -> Self {
        let Replica { config, ownership, view } = replica.clone();
        let params = LeaseLockParams {
            lease_name: config.names.leader_lease.into(),
            holder_id: config.incarnation.clone(),
            lease_ttl: config.lease_duration,
        };
        Self {
            lock: LeaseLock::new(client.clone(), &config.namespace, params),
            configmaps: Api::namespaced(client.clone(), &config.namespace),
            floor: EpochFloor::new(client.clone(), &config.floor_object, config.names.floor_annotation),
            census: Arc::new(Census::new(client.clone(), &config.floor_object, config.watch_namespace.clone())),
            leases: Api::namespaced(client, &config.namespace),
            duties,
            config,
            ownership,
            members,
            view,
            known_since: Mutex::default(),
            confirmed_silent: Mutex::default(),
            last_planned: Mutex::default(),
            steadiness: Mutex::default(),
            idle_logged: Mutex::default(),
            loss_logged: Mutex::default(),
        }
    }

    /// Campaigns and leads until `stop`; returns whether we were leading at the end.
    pub async fn run(&self, stop: CancellationToken) -> bool {
        let mut leading_until: Option<Instant> = None;
        let mut next_attempt = Instant::now();
        // Cancelled when we stop leading; the duties' task then ends by itself.
        let mut duties: Option<CancellationToken> = None;
        let mut was_leading = false;
        let mut members_changed = self.members.subscribe();
        let mut view_changed = self.view.subscribe();
        let mut counted = self.census.subscribe();
        loop {
            let now = Instant::now();
            if now >= next_attempt {
                next_attempt = now + self.config.retry_period;
                // Only a member whose own lease is valid may lead, and only one that can plan:
                // a leader whose member watch stalls steps down for another to lead.
                let view_current = self.view_current(now);
                if self.ownership.lease_valid() && view_current {
                    match tokio::time::timeout(self.config.renew_deadline, self.lock.try_acquire_or_renew()).await {
                        Ok(Ok(LeaseLockResult::Acquired(_))) => leading_until = Some(now + self.config.renew_deadline),
                        Ok(Ok(_)) => leading_until = None,
                        Ok(Err(error)) => tracing::debug!(%error, "leader election attempt failed"),
                        Err(_) => tracing::debug!("leader election attempt timed out"),
                    }
                } else if !view_current && self.leading(leading_until) && self.another_may_lead() {
                    self.step_down_stale().await;
                    leading_until = None;
                }
            }
            let leading = self.leading(leading_until);
            m::set_leader(self.config.names.program, leading);
            if leading {
                if !was_leading {
                    tracing::info!("became the leader");
                    let stop_duties = CancellationToken::new();
                    if let Some(work) = self.duties.lead(self.ownership.mode(), stop_duties.clone()) {
                        tokio::spawn(work);
                    }
                    tokio::spawn({
                        let (census, members, stop) = (self.census.clone(), self.members.clone(), stop_duties.clone());
                        let splits = self.config.split_ranges && self.ownership.mode() == Mode::ShardSelector;
                        async move { census.keep(|| splits || members.with(|t| t.any_capacity()), stop).await }
                    });
                    duties = Some(stop_duties);
                }
                self.publish(None).await;
                self.collect_abandoned().await;
                let known = self.ownership.generation();
                match tokio::time::timeout(self.config.renew_deadline, self.floor.keep(known)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => tracing::warn!(%error, "could not check the generation floor"),
                    Err(_) => tracing::warn!("checking the generation floor timed out"),
                }
            } else if was_leading {
                tracing::info!("no longer the leader");
                if let Some(stop_duties) = duties.take() {
                    stop_duties.cancel();
                }
                self.duties.stopped();
                self.census.forget();
                m::set_slice_imbalance(0.0);
                m::set_unplaced(0, 0);
            }
            was_leading = leading;
            tokio::select! {
                _ = tokio::time::sleep_until(next_attempt) => {}
                _ = members_changed.changed() => {}
                _ = view_changed.changed() => {}
                _ = counted.changed() => {}
                _ = stop.cancelled() => {
                    if let Some(stop_duties) = duties.take() {
                        stop_duties.cancel();
                    }
                    return self.leading(leading_until);
                }
            }
        }
    }

    /// Whether the member view is fit to plan from (see [`fit_to_plan`]).
    fn view_current(&self, now: Instant) -> bool {
        let own_renewal_seen = self.members.with(|t| t.since_last_change(pod_of(&self.config.incarnation), now));
        fit_to_plan(self.members.synced(), false, own_renewal_seen, self.config.renew_deadline)
    }

    /// Whether another member holds a Lease, as last seen: alone, a leader keeps the Lease
    /// with a stale view (it does not plan, but its other duties go on, such as labelling).
    fn another_may_lead(&self) -> bool {
        self.members.with(|t| t.has_others(&self.config.incarnation))
    }

    /// Gives the leader Lease up while the member view is stale: holding it, we could not
    /// plan, and nobody else could either (a dead member's buckets would never move).
    async fn step_down_stale(&self) {
        tracing::warn!(
            renew_deadline = ?self.config.renew_deadline,
            "the member Lease watch has not shown our own renewal within a renew deadline (a stalled or lagging \
             watch): stepping down as leader until it does"
        );
        match tokio::time::timeout(self.config.renew_deadline, self.lock.step_down()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "stepping down failed; the leader Lease expires instead"),
            Err(_) => tracing::warn!("stepping down timed out; the leader Lease expires instead"),
        }
    }

    fn leading(&self, leading_until: Option<Instant>) -> bool {
        leading_until.is_some_and(|t| Instant::now() < t) && self.ownership.lease_valid()
    }

    /// On graceful shutdown, after our member lease is released: give our buckets away
    /// ourselves, then step down, so nobody waits for a new election.
    pub async fn hand_over(&self) {
        self.publish(Some(&self.config.incarnation)).await;
        match tokio::time::timeout(Duration::from_secs(5), self.lock.step_down()).await {
            Ok(Ok(())) => tracing::info!("stepped down as leader"),
            Ok(Err(error)) => tracing::warn!(%error, "stepping down failed"),
            Err(_) => tracing::warn!("stepping down timed out"),
        }
        m::set_leader(self.config.names.program, false);
    }

    /// Plans and publishes until nothing more can change now: a revocation whose owner is
    /// confirmed silent is followed by the reassignment at once.
    async fn publish(&self, leaving: Option<&str>) {
        for _ in 0..3 {
            let Some((next, resource_version)) = self.next(leaving).await else { return };
            if !self.write(&next, resource_version).await {
                return;
            }
        }
    }

    async fn next(&self, leaving: Option<&str>) -> Option<(Assignment, Option<String>)> {
        let me = &self.config.incarnation;
        let now = Instant::now();
        let own_renewal_seen = self.members.with(|table| table.since_last_change(pod_of(me), now));
        if !fit_to_plan(self.members.synced(), leaving.is_some(), own_renewal_seen, self.config.renew_deadline) {
            tracing::debug!("member view is incomplete or stale; not planning");
            return None;
        }
        let mode = self.ownership.mode();
        let (known, resource_version, republish) = match self.view.get() {
            Some(p) => (Some(p.assignment), p.resource_version, p.republish),
            None => (None, None, true),
        };
        // If a member saw a newer generation than we know (a newer assignment than the
        // ConfigMap holds, or a token above every generation), what it gave to whom is lost;
        // the write's precondition fails if the ConfigMap holds one we have yet to see.
        let seen = self.members.with(|t| t.highest_generation());
        let known_generation = known.as_ref().map_or(0, |k| k.generation);
        self.log_loss(seen, known_generation);
        let republish = must_republish(republish, known_generation, seen);
        // Published anew, an assignment starts above every generation any install reserved.
        let reserved = match republish {
            true => match self.floor.reserved().await {
                Ok(reserved) => reserved,
                Err(error) => {
                    tracing::warn!(%error, "not publishing the assignment");
                    return None;
                }
            },
            false => 0,
        };
        let current = starting_point(known, republish, reserved, seen, mode);
        self.track_revocations(&current, now);
        self.confirm_silent(&current, now).await;
        let release = |from: &str, since: u64| -> bool {
            if Some(from) == leaving {
                return true; // we drained and released our own lease before handing over
            }
            let facts = self.members.with(|t| DrainFacts {
                acked: t.acked_generation(from),
                released: t.liveness(from, now) == Liveness::Released,
                confirmed_silent: self.lock_confirmed().contains(&(from.to_string(), since)),
                revoked_for: self.revoked_for(since, now),
                lease_duration: t.lease_duration(from).unwrap_or(self.config.lease_duration),
            });
            may_reassign(since, facts)
        };
        let mut receivers =
            self.members.with(|t| t.receivers(leaving.is_none().then_some(me.as_str()), mode.as_str(), now));
        self.log_idle(mode, now);
        if let Some(leaving) = leaving {
            receivers.remove(leaving);
        }
        m::set_members_alive(receivers.len());
        let ranges = self.ranges_wanted(&current, &receivers, leaving.is_some());
        let rebalanced = if leaving.is_none() { self.rebalance(&current, &receivers) } else { None };
        let capacities = self.members.with(|t| t.capacities(&receivers));
        if capacity::reported_over(&self.members.with(|t| t.load_reports()), &capacities) {
            self.census.count_soon();
        }
        let census = self.census.latest();
        let plan = planning::plan(Inputs {
            current,
            republish,
            mode,
            receivers: &receivers,
            ranges,
            census: census.as_ref(),
            capacities: &capacities,
            rebalanced,
            release: &release,
        });
        self.report(&plan, now);
        plan.into_next().map(|next| (next, resource_version))
    }

    /// Says what a plan does: in logs when it changes the mode or the ranges, in metrics
    /// when it places.
    fn report(&self, plan: &Plan, now: Instant) {
        match plan {
            Plan::VacateMode { from, next: Some(_) } => {
                tracing::warn!(from = from.as_str(), to = self.ownership.mode().as_str(), "changing the sharding mode");
            }
            Plan::VacateRanges { buckets, next: Some(_) } => {
                tracing::info!(buckets, "changing hash ranges: revoking the changed buckets first");
            }
            Plan::VacateMode { .. } | Plan::VacateRanges { .. } => {}
            Plan::Uncounted => {
                tracing::debug!("members advertise capacities; not planning before the objects are counted");
            }
            Plan::Place { new_ranges, unplaced_buckets, unplaced_objects, unowned, .. } => {
                if let Some((buckets, split)) = new_ranges {
                    tracing::info!(buckets, split, "publishing new hash ranges");
                }
                m::set_unplaced(*unplaced_buckets, *unplaced_objects);
                let last = self.last_planned.lock().unwrap_or_else(|p| p.into_inner()).replace(now);
                m::record_unowned(*unowned, last.map_or(Duration::ZERO, |t| now - t));
            }
        }
    }

    /// The hash ranges to publish in shard-selector mode: split where the counted namespaces
    /// crowd, while this replica may split them and every receiver reads split ranges;
    /// uniform otherwise.
    fn ranges_wanted(&self, current: &Assignment, receivers: &BTreeSet<String>, leaving: bool) -> Ranges {
        if self.ownership.mode() != Mode::ShardSelector || current.mode != Mode::ShardSelector {
            return Ranges::default();
        }
        if leaving {
            return current.ranges.clone();
        }
        let may_split = self.config.split_ranges && self.members.with(|t| t.all_read_split_ranges(receivers));
        if !may_split {
            return Ranges::default();
        }
        let Some(namespaces) = self.census.latest() else { return current.ranges.clone() };
        let split = current.ranges.split(&by_hash(&namespaces));
        if split == *current.ranges { current.ranges.clone() } else { Ranges::new(split) }
    }

    /// Says once per change which renewing members get no buckets, and why.
    fn log_idle(&self, mode: Mode, now: Instant) {
        let idle = self.members.with(|t| t.idle(mode.as_str(), now));
        m::set_members_idle(idle.len());
        let mut logged = self.idle_logged.lock().unwrap_or_else(|p| p.into_inner());
        if *logged != idle {
            for (member, why) in &idle {
                tracing::warn!(%member, %why, "giving this member no buckets");
            }
            *logged = idle;
        }
    }

    /// New object counts to balance slices by, when the owners' reports of a settled
    /// assignment say it is worth the moves (see `sharding::balance`).
    fn rebalance(&self, current: &Assignment, receivers: &BTreeSet<String>) -> Option<Counts> {
        let observed = balance::observed(current, &self.members.with(|t| t.load_reports()))?;
        let imbalance =
            balance::imbalance(&balance::loads(receivers, current.slots.iter().map(Slot::owner), &observed));
        m::set_slice_imbalance(imbalance);
        let total = observed.values().map(|n| u64::from(*n)).sum();
        if !self.steadiness.lock().unwrap_or_else(|p| p.into_inner()).observe(total, Instant::now()) {
            return None;
        }
        let rebalanced = balance::rebalance(current, receivers, &observed, self.config.balance)?;
        let oversized = balance::oversized(&observed, receivers.len());
        tracing::info!(
            imbalance = format!("{imbalance:.2}"),
            objects = total,
            ?oversized,
            "balancing slices by their objects"
        );
        Some(rebalanced)
    }

    /// Starts the clock of every revocation we see for the first time.
    fn track_revocations(&self, current: &Assignment, now: Instant) {
        let mut known = self.known_since.lock().unwrap_or_else(|p| p.into_inner());
        track_revocations(&mut known, current, now);
        self.lock_confirmed().retain(|(_, since)| known.contains_key(since));
    }

    fn revoked_for(&self, since: u64, now: Instant) -> Duration {
        let known = self.known_since.lock().unwrap_or_else(|p| p.into_inner());
        known.get(&since).map_or(Duration::ZERO, |t| now.saturating_duration_since(*t))
    }

    /// For each revoked member that we have not seen renew for a lease duration, a quorum
    /// read of its Lease: if it still shows the renewal we saw, no renewal cycle of that
    /// member started after the revocation was written, so it stopped writing long ago.
    async fn confirm_silent(&self, current: &Assignment, now: Instant) {
        for (from, since) in current.revocations() {
            if self.lock_confirmed().contains(&(from.clone(), since)) {
                continue;
            }
            let Some(marker) = self.members.with(|t| t.silent(&from, now)) else { continue };
            let name = format!("{}{}", self.config.names.member_lease_prefix, pod_of(&from));
            // Deleted, unreadable or slow: the revocation's clock decides instead.
            let read = tokio::time::timeout(self.config.renew_deadline, self.leases.get_opt(&name)).await;
            if let Ok(Ok(Some(lease))) = read {
                let state = lease_state(&lease, &self.config.names);
                if state.holder.as_deref() == Some(&from) && state.renew_marker.unwrap_or_default() == marker {
                    tracing::info!(member = %from, since, "confirmed silent since before its revocation");
                    self.lock_confirmed().insert((from, since));
                }
            }
        }
    }

    /// Says once per pair why every bucket is revoked: a member saw more than we know.
    fn log_loss(&self, seen: u64, known: u64) {
        let mut logged = self.loss_logged.lock().unwrap_or_else(|p| p.into_inner());
        if seen > known && *logged != (seen, known) {
            *logged = (seen, known);
            tracing::warn!(
                seen,
                known,
                "a member saw a generation, or a fencing token on an object, above every one we know (a lost \
                 assignment or generation floor): revoking every bucket before granting any"
            );
        }
    }

    fn lock_confirmed(&self) -> std::sync::MutexGuard<'_, BTreeSet<(String, u64)>> {
        self.confirmed_silent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `next` if the ConfigMap is still at `resource_version` (creates it when
    /// `None`); true when written.
    async fn write(&self, next: &Assignment, resource_version: Option<String>) -> bool {
        if let Err(error) = self.floor.reserve(next.generation).await {
            tracing::warn!(%error, generation = next.generation, "not publishing the assignment");
            return false;
        }
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.config.names.assignment_configmap.into()),
                namespace: Some(self.config.namespace.clone()),
                resource_version: resource_version.clone(),
                ..Default::default()
            },
            data: Some(next.encode()),
            ..Default::default()
        };
        let written = match &resource_version {
            Some(_) => {
                self.configmaps.replace(self.config.names.assignment_configmap, &PostParams::default(), &cm).await
            }
            None => self.configmaps.create(&PostParams::default(), &cm).await,
        };
        let overwrote_copy = self.view.get().is_some_and(|p| p.republish) && resource_version.is_some();
        match written {
            Ok(written) => {
                tracing::info!(generation = next.generation, "published assignment");
                let mut known = self.known_since.lock().unwrap_or_else(|p| p.into_inner());
                if overwrote_copy {
                    // While the older copy was stored, a member could read it and miss a
                    // revocation: every revocation's clock starts again from this write.
                    known.values_mut().for_each(|since| *since = Instant::now());
                }
                known.insert(next.generation, Instant::now());
                drop(known);
                self.view.offer(next.clone(), written.resource_version());
                true
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {
                tracing::warn!("the assignment ConfigMap is gone; publishing it anew");
                self.view.gone();
                false
            }
            // Someone wrote first (a newer view, or another leader): re-plan from the watch.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                tracing::debug!("assignment changed meanwhile; re-planning");
                false
            }
            Err(error) => {
                tracing::warn!(%error, "publishing the assignment failed");
                false
            }
        }
    }

    /// Deletes member Leases nobody has renewed for a long time (pods scaled away), with a
    /// precondition, so a Lease renewed meanwhile is kept.
    async fn collect_abandoned(&self) {
        let after = self.config.lease_duration * ABANDONED_AFTER_LEASES;
        let abandoned = self.members.with(|t| {
            t.abandoned(after, Instant::now()).into_iter().map(|pod| (t.renew_marker(&pod), pod)).collect::<Vec<_>>()
        });
        for (marker, pod) in abandoned {
            let name = format!("{}{pod}", self.config.names.member_lease_prefix);
            let Ok(Some(lease)) = self.leases.get_opt(&name).await else { continue };
            if lease_state(&lease, &self.config.names).renew_marker != marker {
                continue;
            }
            let preconditions = Preconditions { uid: lease.uid(), resource_version: lease.resource_version() };
            let params = DeleteParams { preconditions: Some(preconditions), ..Default::default() };
            match self.leases.delete(&name, &params).await {
                Ok(_) => tracing::info!(lease = %name, "deleted an abandoned member lease"),
                Err(error) => tracing::debug!(%error, lease = %name, "could not delete an abandoned member lease"),
            }
        }
    }
}

/// Whether the member view is good enough to plan from: the member watch has listed, and it
/// is current, since it showed our own Lease renewed within a renew deadline (a leader cut
/// off from the watch would plan on a stale picture). On the way out, after our own Lease
/// was released, only the listing counts.
fn fit_to_plan(synced: bool, leaving: bool, own_renewal_seen: Option<Duration>, renew_deadline: Duration) -> bool {
    let current = own_renewal_seen.is_some_and(|ago| ago < renew_deadline);
    synced && (leaving || current)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_plans_only_from_a_listed_and_current_member_view() {
        let (deadline, s) = (Duration::from_secs(10), Duration::from_secs);
        assert!(fit_to_plan(true, false, Some(s(2)), deadline));
        assert!(!fit_to_plan(false, false, Some(s(2)), deadline), "the member watch has not listed");
        assert!(!fit_to_plan(true, false, Some(s(10)), deadline), "our own renewal not seen for a renew deadline");
        assert!(!fit_to_plan(true, false, None, deadline), "our own Lease never seen");
        assert!(fit_to_plan(true, true, None, deadline), "handing over after our Lease was released");
        assert!(!fit_to_plan(false, true, None, deadline), "but never before the listing");
    }
}
