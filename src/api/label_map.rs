//! A label map that is cheap to cache.
//!
//! A `BTreeMap<String, String>` with a single entry allocates a whole B-tree leaf (eleven
//! key and value slots, over 500 bytes); a sorted `Vec` of pairs allocates what it holds.
//! Selectors have a handful of entries, and every decoded policy holds one. A boxed slice
//! rather than a `Vec` also saves the capacity word.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Label key/value pairs, sorted by key, serialized as a JSON object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelMap(Box<[(String, String)]>);

impl LabelMap {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn to_btree(&self) -> BTreeMap<String, String> {
        self.0.iter().cloned().collect()
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for LabelMap {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let sorted: BTreeMap<String, String> = pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        Self(sorted.into_iter().collect())
    }
}

impl Serialize for LabelMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0.iter() {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for LabelMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LabelMapVisitor;
        impl<'de> Visitor<'de> for LabelMapVisitor {
            type Value = LabelMap;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of label keys to values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<LabelMap, A::Error> {
                let mut pairs = Vec::with_capacity(access.size_hint().unwrap_or(0));
                while let Some(pair) = access.next_entry::<String, String>()? {
                    pairs.push(pair);
                }
                Ok(pairs.into_iter().collect())
            }
        }
        deserializer.deserialize_map(LabelMapVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_as_a_sorted_json_object() {
        let labels: LabelMap = serde_json::from_str(r#"{"tier":"web","app":"shop"}"#).unwrap();
        assert_eq!(labels.iter().collect::<Vec<_>>(), [("app", "shop"), ("tier", "web")]);
        assert_eq!(serde_json::to_string(&labels).unwrap(), r#"{"app":"shop","tier":"web"}"#);
        assert_eq!(labels.to_btree()["tier"], "web");
    }
}
