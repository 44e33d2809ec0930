//! What a decision speaks of: the trigger as received and as validated, the routes a record takes, the drop reasons and the decision.
use serde_json::{Map, Value};
use std::fmt;

/// The binding identity of records made for public packs (§7.5.1).
pub const PUBLIC_BINDING: &str = "public";
/// The land whose records need project membership (§7.5.2).
pub const BRAIN: &str = "brain";

/// How the condition behind a trigger is obtained. Only `Push` is a pack trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TriggerSource {
    Push,
    Poll,
    Timer,
    Monitor,
}

str_enum!(TriggerSource { Push = "push", Poll = "poll", Timer = "timer", Monitor = "monitor" });

/// Where a recorded trigger goes (§7.4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Recorded and surfaced to the principal.
    Inbox,
    /// Recorded, not surfaced.
    Silent,
}

str_enum!(Route { Inbox = "inbox", Silent = "silent" });

/// A well-formed trigger, as handed over by a runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct Trigger {
    pub pack_id: String,
    pub r#ref: String,
    pub principal: String,
    pub land: String,
    pub payload: Map<String, Value>,
    /// Bytes of the payload's JSON text, counted once when the trigger is validated: the
    /// payload limit and the payload schema's check (inline or on the pool) both read it.
    pub payload_bytes: usize,
    pub project: Option<String>,
    pub trigger_id: Option<String>,
}

/// Bytes of `v`'s JSON text, counted without writing it anywhere.
pub fn json_len(v: &impl serde::Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    match serde_json::to_writer(&mut c, v) {
        Ok(()) => c.0,
        Err(_) => usize::MAX,
    }
}

/// What a trigger id stands for within its pack: the trigger's principal, ref, land and
/// payload. A retry carries the same; the id reused with any of them different is another
/// trigger (a conflict), never answered with the first one's record, which would acknowledge
/// the second message and lose it. Payloads compare as JSON objects: key order and spacing
/// do not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity<'a> {
    pub principal: &'a str,
    pub r#ref: &'a str,
    pub land: &'a str,
    pub payload: &'a Map<String, Value>,
}

impl Trigger {
    pub fn identity(&self) -> Identity<'_> {
        Identity {
            principal: &self.principal,
            r#ref: &self.r#ref,
            land: &self.land,
            payload: &self.payload,
        }
    }
}

/// A trigger as received, before validation.
#[derive(Debug, Clone, Default)]
pub struct RawTrigger {
    pub pack_id: String,
    pub r#ref: String,
    pub principal: String,
    pub land: String,
    /// The payload; `None` when none was sent (read as `{}`).
    pub payload: Option<Value>,
    pub project: String,
    pub trigger_id: String,
    /// `None` when unspecified (read as push); `Err` holds an unknown value.
    pub source: Option<Result<TriggerSource, i32>>,
}

/// Why a trigger was dropped, in the order `decide` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    UnknownPack,
    UndeclaredRef,
    NoGrant,
    NoConnectedBinding,
    LandMismatch,
    ActivationOff,
    /// The service's own `binding.degraded` whose Policy land is `brain`: a brain record
    /// needs a project and a Binding has none (§7.5.2, §7.7.3).
    NoProject,
    /// The activation's filter said not to record the trigger.
    Filtered,
    /// The activation's filter failed on the trigger, or yielded neither a bool nor a route.
    FilterError,
}

impl DropReason {
    pub const ALL: [DropReason; 9] = [
        DropReason::UnknownPack,
        DropReason::UndeclaredRef,
        DropReason::NoGrant,
        DropReason::NoConnectedBinding,
        DropReason::LandMismatch,
        DropReason::ActivationOff,
        DropReason::NoProject,
        DropReason::Filtered,
        DropReason::FilterError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::UnknownPack => "unknown_pack",
            DropReason::UndeclaredRef => "undeclared_ref",
            DropReason::NoGrant => "no_grant",
            DropReason::NoConnectedBinding => "no_connected_binding",
            DropReason::LandMismatch => "land_mismatch",
            DropReason::ActivationOff => "activation_off",
            DropReason::NoProject => "no_project",
            DropReason::Filtered => "filtered",
            DropReason::FilterError => "filter_error",
        }
    }

    pub fn parse(s: &str) -> Option<DropReason> {
        DropReason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do with a trigger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Record { route: Route, binding_id: String },
    Drop(DropReason),
}

impl Decision {
    /// `recorded_inbox`, `recorded_silent` or `dropped`, as spans and metrics name it.
    pub fn disposition(&self) -> &'static str {
        disposition(match self {
            Decision::Record { route, .. } => Some(*route),
            Decision::Drop(_) => None,
        })
    }
}

/// The one mapping from a route (none: dropped) to a disposition's name.
fn disposition(route: Option<Route>) -> &'static str {
    match route {
        Some(Route::Inbox) => "recorded_inbox",
        Some(Route::Silent) => "recorded_silent",
        None => "dropped",
    }
}

/// What became of a trigger, as the producer is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// `Some(route)` when recorded.
    pub route: Option<Route>,
    pub drop_reason: Option<DropReason>,
    pub record_id: Option<String>,
    /// The trigger id was seen before for this pack; `record_id` is the first record's.
    pub duplicate: bool,
}

impl Outcome {
    pub fn dropped(reason: DropReason) -> Outcome {
        Outcome {
            route: None,
            drop_reason: Some(reason),
            record_id: None,
            duplicate: false,
        }
    }

    pub fn recorded(route: Route, record_id: String, duplicate: bool) -> Outcome {
        Outcome {
            route: Some(route),
            drop_reason: None,
            record_id: Some(record_id),
            duplicate,
        }
    }

    /// `recorded_inbox`, `recorded_silent` or `dropped`.
    pub fn disposition(&self) -> &'static str {
        disposition(self.route)
    }
}
