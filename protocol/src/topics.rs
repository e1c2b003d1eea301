//! MQTT topic names, all under one versioned namespace: `unifed/v1/{federation}/...`.

use crate::ids::{FederationId, Id, SiteId};
use alloc::format;
use alloc::string::String;

/// Builds (and parses) the topics of one federation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    federation: FederationId,
}

impl Topics {
    /// The topics of `federation`.
    pub fn new(federation: &FederationId) -> Self {
        Topics {
            federation: federation.clone(),
        }
    }

    /// `unifed/v1/{fed}/manifest`: the retained round manifest.
    pub fn manifest(&self) -> String {
        format!("unifed/v1/{}/manifest", self.federation)
    }

    /// `unifed/v1/{fed}/chunks/request/{site}`: a site asks for model chunks.
    pub fn chunk_request(&self, site: &SiteId) -> String {
        format!("unifed/v1/{}/chunks/request/{site}", self.federation)
    }

    /// `unifed/v1/{fed}/chunks/reply/{site}`: the chunks a site asked for.
    pub fn chunk_reply(&self, site: &SiteId) -> String {
        format!("unifed/v1/{}/chunks/reply/{site}", self.federation)
    }

    /// `unifed/v1/{fed}/chunks/model`: round model chunks sent once for every site (each site
    /// reads it beside its own replies).
    pub fn model_chunks(&self) -> String {
        format!("unifed/v1/{}/chunks/model", self.federation)
    }

    /// `unifed/v1/{fed}/update/{site}`: a site's update.
    pub fn update(&self, site: &SiteId) -> String {
        format!("unifed/v1/{}/update/{site}", self.federation)
    }

    /// `unifed/v1/{fed}/update/+`: every site's updates, for the aggregator to subscribe to.
    pub fn updates_filter(&self) -> String {
        format!("unifed/v1/{}/update/+", self.federation)
    }

    /// `unifed/v1/{fed}/ack/{site}`: the aggregator's answers to a site's updates.
    pub fn ack(&self, site: &SiteId) -> String {
        format!("unifed/v1/{}/ack/{site}", self.federation)
    }

    /// `unifed/v1/{fed}/status/{site}`: a site's status (also its MQTT Last Will).
    pub fn status(&self, site: &SiteId) -> String {
        format!("unifed/v1/{}/status/{site}", self.federation)
    }

    /// `unifed/v1/{fed}/status/+`: every site's status.
    pub fn status_filter(&self) -> String {
        format!("unifed/v1/{}/status/+", self.federation)
    }

    /// `unifed/v1/{fed}/onboard/request/{site}`: a site's onboarding requests and registry
    /// entries.
    pub fn onboard_request(&self, site: &SiteId) -> String {
        format!("unifed/v1/{}/onboard/request/{site}", self.federation)
    }

    /// `unifed/v1/{fed}/onboard/request/+`: every site's onboarding requests.
    pub fn onboard_requests_filter(&self) -> String {
        format!("unifed/v1/{}/onboard/request/+", self.federation)
    }

    /// `unifed/v1/{fed}/onboard/reply/{site}`: the aggregator's onboarding replies to a site.
    pub fn onboard_reply(&self, site: &SiteId) -> String {
        format!("unifed/v1/{}/onboard/reply/{site}", self.federation)
    }

    /// The site id at the end of an update, status, ack or chunk-request topic of this
    /// federation; `None` for any other topic or an invalid site id.
    pub fn site_of<'a>(&self, topic: &'a str) -> Option<&'a str> {
        let rest = topic
            .strip_prefix("unifed/v1/")?
            .strip_prefix(self.federation.as_str())?
            .strip_prefix('/')?;
        let site = [
            "update/",
            "status/",
            "ack/",
            "chunks/request/",
            "onboard/request/",
        ]
        .iter()
        .find_map(|kind| rest.strip_prefix(kind))?;
        Id::new(site).ok().map(|_| site)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    #[test]
    fn topics_follow_the_versioned_namespace() {
        let t = Topics::new(&id("fed1"));
        let s = id("site-a");
        assert_eq!(t.manifest(), "unifed/v1/fed1/manifest");
        assert_eq!(t.chunk_request(&s), "unifed/v1/fed1/chunks/request/site-a");
        assert_eq!(t.chunk_reply(&s), "unifed/v1/fed1/chunks/reply/site-a");
        assert_eq!(t.model_chunks(), "unifed/v1/fed1/chunks/model");
        assert_eq!(t.update(&s), "unifed/v1/fed1/update/site-a");
        assert_eq!(t.updates_filter(), "unifed/v1/fed1/update/+");
        assert_eq!(t.ack(&s), "unifed/v1/fed1/ack/site-a");
        assert_eq!(t.status(&s), "unifed/v1/fed1/status/site-a");
        assert_eq!(t.status_filter(), "unifed/v1/fed1/status/+");
        assert_eq!(
            t.onboard_request(&s),
            "unifed/v1/fed1/onboard/request/site-a"
        );
        assert_eq!(
            t.onboard_requests_filter(),
            "unifed/v1/fed1/onboard/request/+"
        );
        assert_eq!(t.onboard_reply(&s), "unifed/v1/fed1/onboard/reply/site-a");
    }

    #[test]
    fn site_of_reads_the_site_back_from_its_topics() {
        let t = Topics::new(&id("fed1"));
        let s = id("site.a_1");
        for topic in [
            t.update(&s),
            t.status(&s),
            t.ack(&s),
            t.chunk_request(&s),
            t.onboard_request(&s),
        ] {
            assert_eq!(t.site_of(&topic), Some("site.a_1"), "{topic}");
        }
    }

    #[test]
    fn site_of_ignores_other_topics_and_other_federations() {
        let t = Topics::new(&id("fed1"));
        let s = id("site");
        assert_eq!(t.site_of(&t.manifest()), None);
        assert_eq!(t.site_of(&t.chunk_reply(&s)), None);
        assert_eq!(t.site_of(&t.model_chunks()), None);
        assert_eq!(t.site_of(&t.onboard_reply(&s)), None);
        assert_eq!(t.site_of(&Topics::new(&id("fed2")).update(&s)), None);
        assert_eq!(t.site_of(&Topics::new(&id("fed10")).update(&s)), None);
        assert_eq!(t.site_of("unifed/v1/fed1/update/"), None);
        assert_eq!(t.site_of("unifed/v1/fed1/update/a/b"), None);
        assert_eq!(t.site_of("unifed/v1/fed1/update/+"), None);
        assert_eq!(t.site_of("unifed/v2/fed1/update/site"), None);
        assert_eq!(t.site_of("unifed/v1/fed1update/site"), None);
    }
}
