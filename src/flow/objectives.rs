//! Priorities from InferenceObjective objects (`flow_control.objective_api`): the watch in
//! `pods::kubernetes` feeds [`Watched`], and [`super::FlowControl::classify`] asks it before the
//! static `objectives` map, so an object wins over a static entry of the same name and the map
//! covers the objectives no object names.
//!
//! Who may change what: anyone who can create InferenceObjectives in the pool's namespace sets
//! the priority of requests naming them, within the configured classes' range (a priority
//! outside it is clamped, counted and logged once per object and value). Memory: at most
//! [`MAX_WATCHED`] names of at most 64 bytes (further objects are dropped and counted).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::RwLock;
use serde_json::Value;
use tracing::warn;

use super::{cut, FlowMetrics};

/// Most objectives kept.
pub const MAX_WATCHED: usize = 1024;

/// The API group a `poolRef` names by default (InferencePool's).
const POOL_GROUP: &str = "inference.networking.k8s.io";

/// What an InferenceObjective says, as far as priority goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Objective {
    /// `metadata.name`: the value a request's objective header carries.
    pub name: String,
    /// `spec.priority` (unset counts as 0, as the API defines).
    pub priority: i64,
    /// Whether `spec.poolRef` names `pool` (group and kind defaulted as the CRD does).
    pub for_pool: bool,
}

impl Objective {
    /// Reads an InferenceObjective object (`metadata`, `spec`); `None` without a name.
    pub fn from_json(obj: &Value, pool: &str) -> Option<Self> {
        let name = obj.get("metadata")?.get("name")?.as_str()?;
        Some(Self::from_spec(name, obj.get("spec"), pool))
    }

    /// An object named `name` with `spec`.
    pub fn from_spec(name: &str, spec: Option<&Value>, pool: &str) -> Self {
        let priority = spec
            .and_then(|s| s.get("priority"))
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let pool_ref = spec.and_then(|s| s.get("poolRef"));
        let field = |k: &str, default: &'static str| {
            pool_ref
                .and_then(|r| r.get(k))
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
                .unwrap_or(default)
                .to_string()
        };
        let for_pool = field("name", "") == pool
            && field("group", POOL_GROUP) == POOL_GROUP
            && field("kind", "InferencePool") == "InferencePool";
        Self {
            name: name.to_string(),
            priority,
            for_pool,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Within the configured range.
    priority: i32,
    /// As the object says it.
    declared: i64,
}

/// The watched objectives of the router's pool: name (cut to 64 bytes) -> priority.
pub struct Watched {
    range: (i32, i32),
    map: RwLock<HashMap<String, Entry>>,
    metrics: FlowMetrics,
    /// The cap was hit (logged once: a relist meets the same objects again).
    cap_logged: AtomicBool,
}

impl Watched {
    /// Empty; priorities are kept within `range` ([`crate::config::FlowConfig::priority_range`]).
    pub fn new(range: (i32, i32), metrics: FlowMetrics) -> Self {
        Self {
            range,
            map: RwLock::new(HashMap::new()),
            metrics,
            cap_logged: AtomicBool::new(false),
        }
    }

    /// The priority of the objective a request names, when an object names it.
    pub fn priority(&self, name: &str) -> Option<i32> {
        self.map.read().get(cut(name)).map(|e| e.priority)
    }

    /// Objectives known now.
    pub fn len(&self) -> usize {
        self.map.read().len()
    }

    /// Whether none is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An object was added or changed: kept when it names the pool, else forgotten.
    pub fn apply(&self, obj: &Objective) {
        let mut map = self.map.write();
        self.apply_to(&mut map, obj);
        self.metrics.objectives_known(map.len());
    }

    /// An object was deleted.
    pub fn delete(&self, name: &str) {
        let mut map = self.map.write();
        map.remove(cut(name));
        self.metrics.objectives_known(map.len());
    }

    /// An object of the pool met while a list is gathered past [`MAX_WATCHED`]: not kept.
    pub fn dropped(&self) {
        self.metrics.objective_limited("over_cap");
        if !self.cap_logged.swap(true, Ordering::Relaxed) {
            warn!(
                cap = MAX_WATCHED,
                "InferenceObjectives past the cap are dropped (counted)"
            );
        }
    }

    /// A complete list (the watch's first list, or a relist) replaces what was known.
    pub fn replace(&self, objs: &[Objective]) {
        let mut map = self.map.write();
        let old = std::mem::take(&mut *map);
        for obj in objs {
            self.apply_with(&mut map, &old, obj);
        }
        self.metrics.objectives_known(map.len());
    }

    fn apply_to(&self, map: &mut HashMap<String, Entry>, obj: &Objective) {
        let prev = map.get(cut(&obj.name)).copied();
        let key = cut(&obj.name).to_string();
        if !obj.for_pool {
            map.remove(&key);
            return;
        }
        self.insert(map, key, prev, obj);
    }

    fn apply_with(
        &self,
        map: &mut HashMap<String, Entry>,
        old: &HashMap<String, Entry>,
        obj: &Objective,
    ) {
        if !obj.for_pool {
            return;
        }
        let key = cut(&obj.name).to_string();
        let prev = map.get(&key).or_else(|| old.get(&key)).copied();
        self.insert(map, key, prev, obj);
    }

    fn insert(
        &self,
        map: &mut HashMap<String, Entry>,
        key: String,
        prev: Option<Entry>,
        obj: &Objective,
    ) {
        if !map.contains_key(&key) && map.len() >= MAX_WATCHED {
            self.dropped();
            return;
        }
        let (lo, hi) = self.range;
        let priority = obj.priority.clamp(i64::from(lo), i64::from(hi)) as i32;
        // Counted and logged once per object and declared value, not on every relist.
        if i64::from(priority) != obj.priority && prev.map(|p| p.declared) != Some(obj.priority) {
            self.metrics.objective_limited("clamped");
            warn!(
                objective = %key,
                declared = obj.priority,
                priority,
                lo,
                hi,
                "InferenceObjective priority outside the configured classes' range; clamped"
            );
        }
        map.insert(
            key,
            Entry {
                priority,
                declared: obj.priority,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::registry::Registry;
    use serde_json::json;

    fn watched(range: (i32, i32)) -> (Watched, Registry) {
        let mut reg = Registry::default();
        let cfg = crate::config::FlowConfig::default();
        let m = FlowMetrics::register(reg.sub_registry_with_prefix("kv_router"), &cfg);
        (Watched::new(range, m), reg)
    }

    fn metric(reg: &Registry, line: &str) -> Option<String> {
        let mut s = String::new();
        encode(&mut s, reg).unwrap();
        s.lines()
            .find(|l| l.starts_with(line))
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
    }

    fn obj(name: &str, priority: i64) -> Objective {
        Objective {
            name: name.into(),
            priority,
            for_pool: true,
        }
    }

    #[test]
    fn only_objectives_of_the_pool_count() {
        let read = |v: Value| Objective::from_json(&v, "pool").unwrap();
        let o = read(json!({"metadata": {"name": "chat"},
            "spec": {"priority": 5, "poolRef": {"name": "pool"}}}));
        assert_eq!(o, obj("chat", 5));
        // The CRD's defaults, spelled out, are the same pool.
        let o = read(json!({"metadata": {"name": "chat"}, "spec": {"priority": 5,
            "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool"}}}));
        assert!(o.for_pool);
        for other in [
            json!({"name": "other"}),
            json!({"name": "pool", "group": "inference.networking.x-k8s.io"}),
            json!({"name": "pool", "kind": "Service"}),
        ] {
            let o = read(json!({"metadata": {"name": "chat"}, "spec": {"poolRef": other}}));
            assert!(!o.for_pool, "{o:?}");
        }
        // No priority: 0, as the API says.
        let o = read(json!({"metadata": {"name": "x"}, "spec": {"poolRef": {"name": "pool"}}}));
        assert_eq!(o.priority, 0);
        assert!(Objective::from_json(&json!({"spec": {}}), "pool").is_none());

        let (w, _) = watched((-5, 5));
        w.apply(&obj("chat", 3));
        assert_eq!(w.priority("chat"), Some(3));
        // Its poolRef moved to another pool: forgotten.
        w.apply(&Objective {
            for_pool: false,
            ..obj("chat", 3)
        });
        assert_eq!(w.priority("chat"), None);
        w.apply(&obj("chat", 2));
        w.delete("chat");
        assert_eq!(w.priority("chat"), None);
    }

    #[test]
    fn out_of_range_priorities_are_clamped_and_counted_once() {
        let (w, reg) = watched((-1, 10));
        w.apply(&obj("top", 1000));
        w.apply(&obj("low", -50));
        w.apply(&obj("ok", 7));
        assert_eq!(w.priority("top"), Some(10));
        assert_eq!(w.priority("low"), Some(-1));
        assert_eq!(w.priority("ok"), Some(7));
        // The same declared value again (an update, a relist) is not counted again.
        w.apply(&obj("top", 1000));
        w.replace(&[obj("top", 1000), obj("low", -50), obj("ok", 7)]);
        assert_eq!(
            metric(
                &reg,
                "kv_router_flow_objectives_limited_total{reason=\"clamped\"}"
            )
            .as_deref(),
            Some("2")
        );
        assert_eq!(
            metric(&reg, "kv_router_flow_objectives_watched").as_deref(),
            Some("3")
        );
        // A priority past i32 still clamps.
        w.apply(&obj("huge", i64::MAX));
        assert_eq!(w.priority("huge"), Some(10));
    }

    #[test]
    fn the_cap_drops_new_names_and_keeps_updates() {
        let (w, reg) = watched((-100, 100));
        for i in 0..MAX_WATCHED {
            w.apply(&obj(&format!("o{i}"), 1));
        }
        w.apply(&obj("late", 5));
        w.apply(&obj("late", 5));
        assert_eq!(w.priority("late"), None);
        assert_eq!(w.len(), MAX_WATCHED);
        w.apply(&obj("o0", 9));
        assert_eq!(w.priority("o0"), Some(9));
        assert_eq!(
            metric(
                &reg,
                "kv_router_flow_objectives_limited_total{reason=\"over_cap\"}"
            )
            .as_deref(),
            Some("2")
        );
        w.delete("o1");
        w.apply(&obj("late", 5));
        assert_eq!(w.priority("late"), Some(5));
    }

    #[test]
    fn names_are_cut_like_client_supplied_ones() {
        let (w, _) = watched((0, 10));
        let long = format!("{}{}", "a".repeat(64), "tail");
        w.apply(&obj(&long, 4));
        assert_eq!(w.priority(&"a".repeat(64)), Some(4));
        assert_eq!(w.priority(&long), Some(4));
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn a_relist_replaces_everything() {
        let (w, _) = watched((0, 10));
        w.apply(&obj("gone", 1));
        w.replace(&[
            obj("kept", 2),
            Objective {
                for_pool: false,
                ..obj("elsewhere", 3)
            },
        ]);
        assert_eq!(w.priority("gone"), None);
        assert_eq!(w.priority("kept"), Some(2));
        assert_eq!(w.priority("elsewhere"), None);
    }
}
