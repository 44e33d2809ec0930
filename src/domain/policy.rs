//! The policy a decision reads: packs' declared refs and lands, and per principal the grant, Binding and activation.
use std::collections::HashMap;
use std::sync::Arc;

use super::filter::Filter;
use super::pack::schema::TriggerTypes;
use super::pack::{BindingMode, Manifest};
use super::quota::Rule;
pub use super::trigger::Route;

/// A Binding's health (§7.7.2). Only `Linked` is connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindingState {
    Linked,
    Stale,
    NeedsReauth,
    Pending,
    Error,
}

str_enum!(BindingState {
    Linked = "linked",
    Stale = "stale",
    NeedsReauth = "needs_reauth",
    Pending = "pending",
    Error = "error",
});

/// A principal's Binding to a pack, as the decision needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindingRef {
    pub binding_id: String,
    pub state: BindingState,
}

/// A Sense activation: on with a route and, optionally, a filter; or off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Activation {
    On(Route, Option<Arc<Filter>>),
    Off,
}

/// Off, for principals with no activation in force.
static OFF: Activation = Activation::Off;

/// What one principal holds for one pack.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrincipalPolicy {
    pub granted: bool,
    pub binding: Option<BindingRef>,
    /// The principal's own activation; `None` falls back to the pack-wide one.
    pub activation: Option<Activation>,
    /// The principal's own quota for the pack, besides the pack's.
    pub quota: Option<Rule>,
}

impl PrincipalPolicy {
    pub fn is_empty(&self) -> bool {
        !self.granted && self.binding.is_none() && self.activation.is_none() && self.quota.is_none()
    }
}

/// One registered pack's policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackPolicy {
    pub binding_mode: BindingMode,
    /// Declared ref → the land of its Policy entry.
    pub lands: HashMap<String, String>,
    /// Pack-wide activation, for principals without one of their own.
    pub activation: Option<Activation>,
    /// The quota on all the pack's deliveries, whoever they are for.
    pub quota: Option<Rule>,
    pub principals: HashMap<String, PrincipalPolicy>,
    /// Declared refs' descriptions and compiled payload schemas, shared by every view.
    pub trigger_types: Arc<TriggerTypes>,
}

impl PackPolicy {
    /// A pack's policy from its manifest, with the manifest's trigger types compiled.
    pub fn from_manifest(m: &Manifest) -> PackPolicy {
        PackPolicy::with_trigger_types(m, Arc::new(TriggerTypes::of_manifest(&m.raw)))
    }

    /// A pack's policy from its manifest, with its trigger types compiled already.
    pub fn with_trigger_types(m: &Manifest, trigger_types: Arc<TriggerTypes>) -> PackPolicy {
        let mut p = PackPolicy::declared(
            m.binding_mode,
            &m.triggers
                .iter()
                .map(|t| t.r#ref.as_str())
                .collect::<Vec<_>>(),
            m.stimuli.iter().map(|s| (s.r#ref.clone(), s.land.clone())),
        );
        p.trigger_types = trigger_types;
        p
    }

    /// A pack's policy with no principals yet: each declared ref with the land of its Policy
    /// entry, as (ref, land) pairs; an entry for a ref the pack does not declare is no land.
    pub fn declared(
        binding_mode: BindingMode,
        refs: &[&str],
        stimuli: impl IntoIterator<Item = (String, String)>,
    ) -> PackPolicy {
        PackPolicy {
            binding_mode,
            lands: stimuli
                .into_iter()
                .filter(|(r, _)| refs.contains(&r.as_str()))
                .collect(),
            activation: None,
            quota: None,
            principals: HashMap::new(),
            trigger_types: Arc::default(),
        }
    }

    /// The activation in force for a principal: its own, else the pack-wide one, else off.
    pub fn activation_for<'a>(&'a self, principal: Option<&'a PrincipalPolicy>) -> &'a Activation {
        principal
            .and_then(|p| p.activation.as_ref())
            .or(self.activation.as_ref())
            .unwrap_or(&OFF)
    }
}

/// An immutable snapshot of all policy. Decisions read it without locks; writers
/// replace it whole after their change commits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyView {
    packs: HashMap<String, Arc<PackPolicy>>,
}

impl PolicyView {
    pub fn pack(&self, pack_id: &str) -> Option<&PackPolicy> {
        self.packs.get(pack_id).map(Arc::as_ref)
    }

    pub fn pack_ids(&self) -> impl Iterator<Item = &str> {
        self.packs.keys().map(String::as_str)
    }

    /// A copy with one pack's policy set (or removed with `None`).
    pub fn with_pack(&self, pack_id: &str, pack: Option<PackPolicy>) -> PolicyView {
        let mut packs = self.packs.clone();
        match pack {
            Some(p) => packs.insert(pack_id.to_owned(), Arc::new(p)),
            None => packs.remove(pack_id),
        };
        PolicyView { packs }
    }

    /// A copy with one principal's policy for one pack changed by `f`.
    /// Unknown packs are left alone: their policy is loaded when they register.
    pub fn with_principal(
        &self,
        pack_id: &str,
        principal: &str,
        f: impl FnOnce(&mut PrincipalPolicy),
    ) -> PolicyView {
        let Some(pack) = self.packs.get(pack_id) else {
            return self.clone();
        };
        let mut pack = PackPolicy::clone(pack);
        let entry = pack.principals.entry(principal.to_owned()).or_default();
        f(entry);
        if entry.is_empty() {
            pack.principals.remove(principal);
        }
        self.with_pack(pack_id, Some(pack))
    }

    /// A copy with a pack-wide activation changed.
    pub fn with_pack_activation(
        &self,
        pack_id: &str,
        activation: Option<Activation>,
    ) -> PolicyView {
        let Some(pack) = self.packs.get(pack_id) else {
            return self.clone();
        };
        let mut pack = PackPolicy::clone(pack);
        pack.activation = activation;
        self.with_pack(pack_id, Some(pack))
    }

    /// A copy with a pack-wide quota changed.
    pub fn with_pack_quota(&self, pack_id: &str, quota: Option<Rule>) -> PolicyView {
        let Some(pack) = self.packs.get(pack_id) else {
            return self.clone();
        };
        let mut pack = PackPolicy::clone(pack);
        pack.quota = quota;
        self.with_pack(pack_id, Some(pack))
    }

    /// The quotas a delivery of `pack_id` for `principal` must pass: the principal's, then the pack's.
    pub fn quotas(&self, pack_id: &str, principal: &str) -> (Option<Rule>, Option<Rule>) {
        let Some(pack) = self.packs.get(pack_id) else {
            return (None, None);
        };
        (
            pack.principals.get(principal).and_then(|p| p.quota),
            pack.quota,
        )
    }

    /// Builds a view from whole packs.
    pub fn from_packs(packs: impl IntoIterator<Item = (String, PackPolicy)>) -> PolicyView {
        PolicyView {
            packs: packs.into_iter().map(|(k, v)| (k, Arc::new(v))).collect(),
        }
    }
}
