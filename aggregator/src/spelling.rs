//! How a config spells the wire's enums: one convention, lower-case words (`encoding = "f32"`,
//! `"ternaryq8b64"`, `"topk100"`; `bn_policy = "local"`), as `bn_sharing` and `weighting` were
//! spelled already. The older spellings, the wire enums' own names (`"F32"`,
//! `{ Ternary = { block = 256 } }`, `"Local"`), keep working with a deprecation warning, so a
//! site's existing config does not break. A config is always written in the new spelling.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serializer};
use unifed_protocol::encoding::Encoding;
use unifed_protocol::messages::BnPolicy;

/// Warns once per read that `field` is spelled the old way.
fn deprecated(field: &str, old: &str, new: &str) {
    tracing::warn!("config: `{field} = {old}` is deprecated; write `{field} = \"{new}\"`");
}

/// Reads an encoding: its name (`f32`, `ternaryq8b64`, `topk100`, ...), or the old spelling.
pub fn read_encoding<'de, D: Deserializer<'de>>(d: D) -> Result<Encoding, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Spelled {
        Name(String),
        Old(Encoding),
    }
    match Spelled::deserialize(d)? {
        Spelled::Name(s) => {
            let old = match s.as_str() {
                "F32" => Some(Encoding::F32),
                "F16" => Some(Encoding::F16),
                "Q8" => Some(Encoding::Q8),
                _ => None,
            };
            match old {
                Some(e) => {
                    deprecated("encoding", &format!("\"{s}\""), &e.to_string());
                    Ok(e)
                }
                None => s.parse().map_err(D::Error::custom),
            }
        }
        Spelled::Old(e) => {
            e.validate().map_err(D::Error::custom)?;
            deprecated("encoding", &format!("{e:?}"), &e.to_string());
            Ok(e)
        }
    }
}

/// Writes an encoding by its name.
pub fn write_encoding<S: Serializer>(e: &Encoding, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&e.to_string())
}

/// Reads a BN policy: `local` or `global`, or the old `Local` or `Global`.
pub fn read_bn_policy<'de, D: Deserializer<'de>>(d: D) -> Result<BnPolicy, D::Error> {
    let s = String::deserialize(d)?;
    let (policy, old) = match s.as_str() {
        "local" => (BnPolicy::Local, false),
        "global" => (BnPolicy::Global, false),
        "Local" => (BnPolicy::Local, true),
        "Global" => (BnPolicy::Global, true),
        other => {
            return Err(D::Error::custom(format!(
                "unknown bn_policy `{other}`: local (client-specific BN, FedBN) or global (BN averaged, FedAvg)"
            )));
        }
    };
    if old {
        deprecated("bn_policy", &format!("\"{s}\""), &s.to_lowercase());
    }
    Ok(policy)
}

/// Writes a BN policy as `local` or `global`.
pub fn write_bn_policy<S: Serializer>(p: &BnPolicy, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match p {
        BnPolicy::Local => "local",
        BnPolicy::Global => "global",
    })
}

/// Reads a list of BN policies, each as [`read_bn_policy`] reads one.
pub fn read_bn_policies<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BnPolicy>, D::Error> {
    /// One policy of the list.
    struct One(BnPolicy);
    impl<'de> Deserialize<'de> for One {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            read_bn_policy(d).map(One)
        }
    }
    Ok(Vec::<One>::deserialize(d)?
        .into_iter()
        .map(|o| o.0)
        .collect())
}

/// Writes a list of BN policies as `local` and `global`.
pub fn write_bn_policies<S: Serializer>(p: &[BnPolicy], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(p.len()))?;
    for policy in p {
        seq.serialize_element(match policy {
            BnPolicy::Local => "local",
            BnPolicy::Global => "global",
        })?;
    }
    seq.end()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Cfg {
        #[serde(deserialize_with = "read_encoding", serialize_with = "write_encoding")]
        encoding: Encoding,
        #[serde(
            deserialize_with = "read_bn_policy",
            serialize_with = "write_bn_policy"
        )]
        bn_policy: BnPolicy,
    }

    fn read(text: &str) -> Result<Cfg, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn new_and_old_spellings_read_the_same_and_a_config_is_written_in_the_new_one() {
        for (new, old, encoding) in [
            ("\"f32\"", "\"F32\"", Encoding::F32),
            ("\"q8\"", "\"Q8\"", Encoding::Q8),
            (
                "\"ternaryq8b64\"",
                "{ TernaryQ8 = { block = 64 } }",
                Encoding::TernaryQ8 { block: 64 },
            ),
            (
                "\"topk100\"",
                "{ TopK = { per_mille = 100 } }",
                Encoding::TopK { per_mille: 100 },
            ),
        ] {
            let want = Cfg {
                encoding,
                bn_policy: BnPolicy::Global,
            };
            assert_eq!(
                read(&format!("encoding = {new}\nbn_policy = \"global\"")),
                Ok(want)
            );
            let old_cfg = read(&format!("encoding = {old}\nbn_policy = \"Global\"")).unwrap();
            assert_eq!(
                old_cfg,
                Cfg {
                    encoding,
                    bn_policy: BnPolicy::Global
                }
            );
            let written = toml::to_string(&old_cfg).unwrap();
            assert_eq!(
                written,
                format!("encoding = {new}\nbn_policy = \"global\"\n")
            );
        }
    }

    #[test]
    fn a_list_of_policies_reads_either_spelling_and_is_written_in_the_new_one() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Presets {
            #[serde(
                deserialize_with = "read_bn_policies",
                serialize_with = "write_bn_policies"
            )]
            policies: Vec<BnPolicy>,
        }
        let p: Presets = toml::from_str("policies = [\"Local\", \"global\"]").unwrap();
        assert_eq!(p.policies, [BnPolicy::Local, BnPolicy::Global]);
        assert_eq!(
            toml::to_string(&p).unwrap(),
            "policies = [\"local\", \"global\"]\n"
        );
        assert!(toml::from_str::<Presets>("policies = [\"both\"]").is_err());
    }

    #[test]
    fn a_misspelt_encoding_or_policy_is_refused_naming_the_choices() {
        let e = read("encoding = \"f64\"\nbn_policy = \"local\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown encoding `f64`") && e.contains("ternaryq8"),
            "{e}"
        );
        let e = read("encoding = \"f32\"\nbn_policy = \"LOCAL\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown bn_policy `LOCAL`") && e.contains("global"),
            "{e}"
        );
        let e = read("encoding = { Ternary = { block = 3 } }\nbn_policy = \"local\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("block"), "{e}");
    }
}
