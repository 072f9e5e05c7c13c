//! The CRD's spellings of the engine's speculation modes and verify policies: the contract's
//! kinds themselves (`dspark_types::contract`), serialized as their flag spelling, with a
//! schema whose `enum` is the contract's `ALL` list. A new kind in the contract is a new
//! value here without an edit.

use std::borrow::Cow;

use dspark_types::{PolicyKind, Speculation as EngineSpeculation};
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `impl JsonSchema for $t`: an inline string schema, described by `$description`, whose
/// values are `$values` (a `Vec<&'static str>`).
macro_rules! string_enum_schema {
    ($t:ident, $description:literal, $values:expr) => {
        impl JsonSchema for $t {
            fn inline_schema() -> bool {
                true
            }

            fn schema_name() -> Cow<'static, str> {
                stringify!($t).into()
            }

            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                let values: Vec<&'static str> = $values;
                json_schema!({
                    "description": $description,
                    "type": "string",
                    "enum": values,
                })
            }
        }
    };
}

/// Speculative decoding mode (`--speculation`): one of the contract's
/// [`EngineSpeculation::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation(pub EngineSpeculation);

impl Speculation {
    /// The engine's drafter kind.
    pub fn engine_kind(self) -> EngineSpeculation {
        self.0
    }

    /// The engine's `--speculation` value.
    pub fn engine_flag(self) -> &'static str {
        self.0.flag()
    }
}

impl Serialize for Speculation {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.flag())
    }
}

impl<'de> Deserialize<'de> for Speculation {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        EngineSpeculation::parse(&s)
            .map(Speculation)
            .ok_or_else(|| {
                let all: Vec<_> = EngineSpeculation::ALL.iter().map(|k| k.flag()).collect();
                serde::de::Error::custom(format!(
                    "unknown speculation '{s}'; use one of {}",
                    all.join(", ")
                ))
            })
    }
}

string_enum_schema!(
    Speculation,
    "Speculative decoding mode (`--speculation`).",
    EngineSpeculation::ALL.iter().map(|k| k.flag()).collect()
);

/// Verify-length scheduling policy of the engine: `none` (no verify-length scheduling, the
/// engine's plain block verification) or one of the contract's [`PolicyKind::ALL`]; default
/// `dspark`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerPolicy(pub Option<PolicyKind>);

/// The spelling of "no verify-length scheduling".
const NO_POLICY: &str = "none";

impl Default for SchedulerPolicy {
    fn default() -> Self {
        Self(Some(PolicyKind::Dspark))
    }
}

impl SchedulerPolicy {
    /// The engine's policy, if any (the contract spells its `--policy` value).
    pub fn engine_policy(self) -> Option<PolicyKind> {
        self.0
    }

    /// The engine's `--policy` value, if any.
    pub fn engine_flag(self) -> Option<&'static str> {
        self.0.map(PolicyKind::flag)
    }

    /// The CRD's spelling.
    pub fn spelling(self) -> &'static str {
        self.engine_flag().unwrap_or(NO_POLICY)
    }

    /// Every spelling the CRD accepts.
    pub fn spellings() -> Vec<&'static str> {
        std::iter::once(NO_POLICY)
            .chain(PolicyKind::ALL.iter().map(|k| k.flag()))
            .collect()
    }
}

impl Serialize for SchedulerPolicy {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.spelling())
    }
}

impl<'de> Deserialize<'de> for SchedulerPolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == NO_POLICY {
            return Ok(Self(None));
        }
        PolicyKind::parse(&s).map(|k| Self(Some(k))).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown scheduler policy '{s}'; use one of {}",
                Self::spellings().join(", ")
            ))
        })
    }
}

string_enum_schema!(
    SchedulerPolicy,
    "Verify-length scheduling policy of the engine.",
    SchedulerPolicy::spellings()
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRD's values are the contract's, both ways.
    #[test]
    fn spellings_are_the_contracts() {
        for k in EngineSpeculation::ALL {
            let s = Speculation(k);
            let json = serde_json::to_value(s).unwrap();
            assert_eq!(json, k.flag());
            assert_eq!(serde_json::from_value::<Speculation>(json).unwrap(), s);
        }
        assert!(serde_json::from_value::<Speculation>("dspark".into()).is_err());
        for p in std::iter::once(None).chain(PolicyKind::ALL.map(Some)) {
            let s = SchedulerPolicy(p);
            let json = serde_json::to_value(s).unwrap();
            assert_eq!(serde_json::from_value::<SchedulerPolicy>(json).unwrap(), s);
        }
        assert_eq!(
            serde_json::to_value(SchedulerPolicy::default()).unwrap(),
            "dspark"
        );
        assert_eq!(
            SchedulerPolicy::spellings().len(),
            PolicyKind::ALL.len() + 1
        );
    }
}
