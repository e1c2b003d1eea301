//! `unifed-aggregator approve` and `revoke`: the coordinator's side of enrolment, as edits of the
//! service config that keep its comments and layout. A site's request
//! ([`EnrolmentRequest`], made on the site by `unifed-agent enrol`) is checked (its signatures,
//! its federation, a fingerprint read out over another channel) before its key goes into
//! `[federation] sites`; a rotation replaces the site's key and revokes the old one; `revoke`
//! puts a site's key on the `revoked` list, which a running aggregator re-reads at once.

use anyhow::{Context, Result, bail};
use toml_edit::{Array, DocumentMut, InlineTable, Item, Value};
use unifed_protocol::PublicKey;
use unifed_protocol::enrolment::EnrolmentRequest;

/// What an approval did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Approved {
    /// A new site.
    Enrolled,
    /// The site's key was replaced; the old one is revoked.
    Rotated {
        /// The key it replaced.
        old: PublicKey,
    },
    /// The site is enrolled with this key already.
    AlreadyEnrolled,
}

/// The config `text` with `req` approved; refused when a signature does not verify, the
/// federation differs, `fingerprint` (when given) is not the key's, the key is revoked, or the
/// site is enrolled with another key and the request is not a rotation from it.
pub fn approve(
    text: &str,
    req: &EnrolmentRequest,
    fingerprint: Option<&str>,
) -> Result<(String, Approved)> {
    req.verify()?;
    unifed_protocol::Id::new(&req.site).map_err(|e| anyhow::anyhow!("site `{}`: {e}", req.site))?;
    if let Some(f) = fingerprint
        && f != req.key.fingerprint()
    {
        bail!(
            "the request's key has fingerprint {}, not {f}: do not approve it",
            req.key.fingerprint()
        );
    }
    let mut doc: DocumentMut = text.parse().context("reading the config")?;
    let fed = doc["federation"]
        .as_table_mut()
        .context("the config has no [federation]")?;
    if fed.get("federation").and_then(|v| v.as_str()) != Some(req.federation.as_str()) {
        bail!(
            "the request is for federation `{}`, not this config's",
            req.federation
        );
    }
    if revoked(fed).contains(&req.key) {
        bail!("key {} is revoked", req.key.fingerprint());
    }
    let sites = fed
        .entry("sites")
        .or_insert(Item::Value(Value::Array(Array::new())))
        .as_array_mut()
        .context("`sites` is not an array")?;
    let current = sites.iter_mut().find_map(|v| {
        let t = v.as_inline_table_mut()?;
        (t.get("id")?.as_str()? == req.site).then_some(t)
    });
    let outcome = match current {
        None => {
            if req.previous.is_some() {
                bail!(
                    "`{}` is not enrolled: a rotation needs an enrolled site",
                    req.site
                );
            }
            let mut t = InlineTable::new();
            t.insert("id", req.site.as_str().into());
            t.insert("key", req.key.to_string().into());
            sites.push(Value::InlineTable(t));
            Approved::Enrolled
        }
        Some(t) => {
            let key: PublicKey = t
                .get("key")
                .and_then(|k| k.as_str())
                .context("an enrolled site without a key")?
                .parse()
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if key == req.key {
                Approved::AlreadyEnrolled
            } else if req.previous == Some(key) {
                t.insert("key", req.key.to_string().into());
                Approved::Rotated { old: key }
            } else {
                bail!(
                    "`{}` is enrolled with key {}: only a rotation signed by that key replaces it",
                    req.site,
                    key.fingerprint()
                );
            }
        }
    };
    if let Approved::Rotated { old } = &outcome {
        push_revoked(fed, old)?;
    }
    Ok((doc.to_string(), outcome))
}

/// The config `text` with the key of `site` on the `revoked` list (the site stays enrolled,
/// its key refused); returns the key revoked.
pub fn revoke(text: &str, site: &str) -> Result<(String, PublicKey)> {
    let mut doc: DocumentMut = text.parse().context("reading the config")?;
    let fed = doc["federation"]
        .as_table_mut()
        .context("the config has no [federation]")?;
    let key = fed
        .get("sites")
        .and_then(|s| s.as_array())
        .and_then(|sites| {
            sites.iter().find_map(|v| {
                let t = v.as_inline_table()?;
                (t.get("id")?.as_str()? == site).then(|| t.get("key")?.as_str())?
            })
        })
        .with_context(|| format!("no enrolled site `{site}`"))?
        .parse::<PublicKey>()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if !revoked(fed).contains(&key) {
        push_revoked(fed, &key)?;
    }
    Ok((doc.to_string(), key))
}

/// The keys on `[federation] revoked`.
fn revoked(fed: &toml_edit::Table) -> Vec<PublicKey> {
    fed.get("revoked")
        .and_then(|r| r.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

fn push_revoked(fed: &mut toml_edit::Table, key: &PublicKey) -> Result<()> {
    fed.entry("revoked")
        .or_insert(Item::Value(Value::Array(Array::new())))
        .as_array_mut()
        .context("`revoked` is not an array")?
        .push(key.to_string());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_protocol::SigningKey;

    const CONFIG: &str = "data_dir = \"d\"\n# the federation\n[federation]\nfederation = \"fed\"\nsites = [\n  { id = \"grey\", key = \"KEY\" }, # the first site\n]\nrevoked = []\n";

    fn key(n: u8) -> SigningKey {
        SigningKey::from_seed([n; 32])
    }

    fn config() -> String {
        CONFIG.replace("KEY", &key(1).public().to_string())
    }

    fn sites(text: &str) -> Vec<(String, PublicKey)> {
        let v: toml::Value = toml::from_str(text).unwrap();
        v["federation"]["sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["id"].as_str().unwrap().to_string(),
                    s["key"].as_str().unwrap().parse().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn a_new_site_is_enrolled_keeping_the_comments_and_a_replay_changes_nothing() {
        let req = EnrolmentRequest::new("fed", "texture", &key(2), None);
        let (text, what) = approve(&config(), &req, Some(&key(2).public().fingerprint())).unwrap();
        assert_eq!(what, Approved::Enrolled);
        assert!(text.contains("# the federation") && text.contains("# the first site"));
        assert_eq!(
            sites(&text),
            [
                ("grey".into(), key(1).public()),
                ("texture".into(), key(2).public())
            ]
        );
        let (again, what) = approve(&text, &req, None).unwrap();
        assert_eq!((what, again), (Approved::AlreadyEnrolled, text));
    }

    #[test]
    fn a_wrong_fingerprint_federation_or_holder_is_refused() {
        let req = EnrolmentRequest::new("fed", "texture", &key(2), None);
        let err = approve(&config(), &req, Some("0000-0000-0000-0000")).unwrap_err();
        assert!(err.to_string().contains("do not approve"), "{err}");
        let other = EnrolmentRequest::new("other", "texture", &key(2), None);
        assert!(approve(&config(), &other, None).is_err());
        // Another key for an enrolled site: refused, unless a rotation signed by its key.
        let stranger = EnrolmentRequest::new("fed", "grey", &key(3), None);
        let err = approve(&config(), &stranger, None).unwrap_err();
        assert!(err.to_string().contains("only a rotation"), "{err}");
        let mut tampered = EnrolmentRequest::new("fed", "texture", &key(2), None);
        tampered.site = "grey".into();
        assert!(approve(&config(), &tampered, None).is_err());
    }

    #[test]
    fn a_rotation_replaces_the_key_and_revokes_the_old_one_and_revoke_revokes() {
        let req = EnrolmentRequest::new("fed", "grey", &key(4), Some(&key(1)));
        let (text, what) = approve(&config(), &req, None).unwrap();
        assert_eq!(
            what,
            Approved::Rotated {
                old: key(1).public()
            }
        );
        assert_eq!(sites(&text), [("grey".into(), key(4).public())]);
        let v: toml::Value = toml::from_str(&text).unwrap();
        assert_eq!(
            v["federation"]["revoked"].as_array().unwrap()[0].as_str(),
            Some(key(1).public().to_string().as_str())
        );
        // The old key cannot come back.
        let back = EnrolmentRequest::new("fed", "grey", &key(1), Some(&key(4)));
        assert!(
            approve(&text, &back, None)
                .unwrap_err()
                .to_string()
                .contains("revoked")
        );
        let (text, k) = revoke(&text, "grey").unwrap();
        assert_eq!(k, key(4).public());
        let v: toml::Value = toml::from_str(&text).unwrap();
        assert_eq!(v["federation"]["revoked"].as_array().unwrap().len(), 2);
        assert!(revoke(&text, "nobody").is_err());
    }
}
