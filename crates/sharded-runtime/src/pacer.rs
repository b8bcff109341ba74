//! An adaptive limit on a client's requests in flight, for bulk work such as labelling many
//! objects: additive increase, multiplicative decrease, as TCP does. A 429 (what is left of
//! one after the client's own retries) halves the limit and holds every new request for the
//! pause its Retry-After asks; each `limit` requests answered otherwise raise it by one.
//! [`paced`] puts a client behind one.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The limit, the requests in flight and any pause; shared by every request of a [`paced`] client.
pub struct Pacer {
    state: Mutex<State>,
    room: Notify,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State {
    limit: usize,
    in_flight: usize,
    /// Requests answered since the limit last grew.
    answered: usize,
    paused_until: Option<Instant>,
}

impl Pacer {
    /// Requests in flight at first.
    pub const START: usize = 16;
    /// Requests in flight at most.
    pub const MAX: usize = 64;

    /// A pacer at [`Pacer::START`].
    pub fn new() -> Arc<Self> {
        let state = State { limit: Self::START, in_flight: 0, answered: 0, paused_until: None };
        Arc::new(Self { state: Mutex::new(state), room: Notify::new() })
    }

    /// How many requests may be in flight now.
    pub fn limit(&self) -> usize {
        self.lock().limit
    }

    /// Waits for room (and the end of a pause), and takes it.
    async fn enter(self: &Arc<Self>) -> Slot {
        loop {
            // Registered before the check, so that room made meanwhile wakes us.
            let room = self.room.notified();
            let pause = {
                let mut state = self.lock();
                match state.paused_until.filter(|until| *until > Instant::now()) {
                    Some(until) => Some(until),
                    None if state.in_flight < state.limit => {
                        state.in_flight += 1;
                        return Slot { pacer: self.clone(), left: false };
                    }
                    None => None,
                }
            };
            match pause {
                Some(until) => tokio::time::sleep_until(until).await,
                None => room.await,
            }
        }
    }

    fn leave(&self, throttled: Option<Duration>) {
        let mut state = self.lock();
        *state = after(*state, throttled, Instant::now());
        drop(state);
        self.room.notify_waiters();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The state after one request left: `throttled` with the pause the server asked for, or
/// answered otherwise (`None`).
fn after(state: State, throttled: Option<Duration>, now: Instant) -> State {
    let in_flight = state.in_flight.saturating_sub(1);
    match throttled {
        Some(pause) => State {
            limit: (state.limit / 2).max(1),
            in_flight,
            answered: 0,
            paused_until: state.paused_until.max(Some(now + pause)),
        },
        None if state.answered + 1 >= state.limit => {
            State { limit: (state.limit + 1).min(Pacer::MAX), in_flight, answered: 0, ..state }
        }
        None => State { in_flight, answered: state.answered + 1, ..state },
    }
}

/// A request's room in the pacer; a request dropped before its answer leaves without a verdict.
struct Slot {
    pacer: Arc<Pacer>,
    left: bool,
}

impl Slot {
    fn leave(mut self, throttled: Option<Duration>) {
        self.left = true;
        self.pacer.leave(throttled);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.left {
            let mut state = self.pacer.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
            drop(state);
            self.pacer.room.notify_waiters();
        }
    }
}

/// `client`, with every request it sends waiting for room in `pacer`. (A client wrapped as
/// `client::with_query` wraps one: kube builds a client's layers once, from its config.)
pub fn paced(client: Client, pacer: Arc<Pacer>) -> Client {
    let default_namespace = client.default_namespace().to_string();
    let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
        let (client, pacer) = (client.clone(), pacer.clone());
        async move {
            let slot = pacer.enter().await;
            let response = client.send(request).await;
            let throttled = match &response {
                Ok(answer) if answer.status() == http::StatusCode::TOO_MANY_REQUESTS => Some(retry_after(answer)),
                _ => None,
            };
            slot.leave(throttled);
            response
        }
    });
    Client::new(service, default_namespace)
}

/// The pause a 429 asks for (its Retry-After in seconds), at least one second.
fn retry_after<B>(answer: &http::Response<B>) -> Duration {
    let seconds = answer.headers().get(http::header::RETRY_AFTER).and_then(|v| v.to_str().ok()?.parse().ok());
    Duration::from_secs(seconds.unwrap_or(1).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(limit: usize) -> State {
        State { limit, in_flight: limit, answered: 0, paused_until: None }
    }

    #[test]
    fn the_limit_halves_on_429_and_grows_by_one_per_limit_answered() {
        let now = Instant::now();
        let mut s = state(Pacer::START);
        for _ in 0..Pacer::START - 1 {
            s = after(s, None, now);
        }
        assert_eq!(s.limit, Pacer::START, "not before a whole limit's worth answered");
        s = after(s, None, now);
        assert_eq!(s.limit, Pacer::START + 1);
        let pause = Duration::from_secs(3);
        s = after(s, Some(pause), now);
        assert_eq!((s.limit, s.paused_until), (8, Some(now + pause)), "17 halved; the server's pause held");
        for _ in 0..10 {
            s = after(s, Some(Duration::from_secs(1)), now);
        }
        assert_eq!(s.limit, 1, "never below one");
        assert_eq!(s.paused_until, Some(now + pause), "a shorter pause does not cut a longer one");
        let mut s = state(Pacer::MAX);
        for _ in 0..10 * Pacer::MAX {
            s = after(s, None, now);
        }
        assert_eq!(s.limit, Pacer::MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_wait_for_room_and_for_the_pause() {
        let pacer = Pacer::new();
        let slots: Vec<Slot> = futures::future::join_all((0..Pacer::START).map(|_| pacer.enter())).await;
        let waiting = tokio::spawn({
            let pacer = pacer.clone();
            async move { pacer.enter().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "no room beyond the limit");
        let mut slots = slots.into_iter();
        slots.next().unwrap().leave(Some(Duration::from_secs(2)));
        tokio::time::sleep(Duration::from_millis(2100)).await;
        assert!(!waiting.is_finished(), "after the pause, 15 in flight over a halved limit of 8: no room");
        assert_eq!(pacer.limit(), Pacer::START / 2);
        drop(slots);
        let entered = tokio::time::timeout(Duration::from_millis(10), waiting).await;
        assert!(entered.is_ok(), "room once the others left");
    }
}
