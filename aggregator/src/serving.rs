//! Which way each chunk a site asks for goes, without I/O: a round model's chunks go out once
//! on the topic every site reads ([`unifed_protocol::topics::Topics::model_chunks`]), so five
//! sites fetching the same model cost the aggregator and the broker's intake one model rather
//! than five; what a site lost, or asked for before it could have heard the shared copy, goes
//! to that site alone, a bounded number of times.
//!
//! A payload is shared only once two sites have asked for it: a late joiner fetching the whole
//! model while the others fetch its delta (or a site that asks for a payload nobody else
//! wants) is sent its chunks alone, and the others are not sent a payload they drop.
//!
//! A site hears a shared chunk for sure only if it was sent after the site's first request for
//! that payload reached the aggregator, and the site has not reconnected since: the site asked
//! after it followed the manifest, so the chunk reaches it after the manifest that names its
//! payload. (Brokers order one client's messages per topic, not across topics, so a chunk sent
//! earlier may overtake the manifest and be dropped as a payload the site does not know yet.)
//! So a chunk shared before that first request is sent to the site alone when it asks, and
//! one shared after it is skipped the first time the site asks and sent to it alone when it
//! asks again. A site whose request says it may have missed what was shared
//! (`ChunkRequest::alone`: it reconnected, or its fetch went quiet) is sent what was shared
//! before alone, and listens again from that request on.
//!
//! Sites ask for a new model within moments of each other, so the first requests for a payload
//! are gathered before anything of it is shared: until every expected site has asked, or for
//! at most a few milliseconds ([`Serving::new`]). Every site that asked meanwhile listened
//! before the first shared chunk, and none is sent its own copy of the first window.

use std::collections::{BTreeMap, BTreeSet};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::Payload;

/// Times one chunk of a payload is sent to one site alone: enough for a site that lost chunks
/// or restarted mid-fetch, never a request storm's amplifier.
pub const MAX_SERVES_PER_CHUNK: u8 = 8;

/// Where a chunk a site asked for goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// To every site, on the shared topic (the first time two or more sites want it).
    Shared,
    /// To the asking site alone.
    Site,
    /// Nowhere: the shared copy is on its way to the site.
    OnItsWay,
    /// Not yet: first requests are being gathered, and [`Serving::due`] sends it soon.
    Gathered,
    /// Nowhere: the site had it [`MAX_SERVES_PER_CHUNK`] times already.
    Refused,
}

/// Where [`Serving::due`] sends a gathered set of chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum To {
    /// Every site, on the shared topic.
    All,
    /// One site alone.
    Site(Id),
}

/// What was sent of one payload of one model version.
#[derive(Debug)]
struct Sent {
    /// When each chunk went out on the shared topic (a count of shared chunks, from 1), or 0.
    shared: Vec<u64>,
    /// Chunks shared so far.
    seq: u64,
    /// Per site: `seq` since when it surely hears what is shared, and per chunk the times it
    /// asked and the times it was sent the chunk alone.
    sites: BTreeMap<Id, (u64, Vec<(u8, u8)>)>,
    /// While first requests are gathered: until when (ms), and the chunks each site asked for.
    gathering: Option<(u64, BTreeMap<Id, BTreeSet<u32>>)>,
}

impl Sent {
    /// Nothing sent yet of a payload of `n` chunks; its first requests gathered until
    /// `gather_until`, if given.
    fn new(n: usize, gather_until: Option<u64>) -> Self {
        Sent {
            shared: vec![0; n],
            seq: 0,
            sites: BTreeMap::new(),
            gathering: gather_until.map(|t| (t, BTreeMap::new())),
        }
    }

    /// Counts chunk `i` as sent to `site` alone once more; false if it had it too often.
    fn alone(&mut self, site: &Id, i: usize) -> bool {
        match self.sites.get_mut(site).and_then(|(_, a)| a.get_mut(i)) {
            Some((_, alone)) if *alone < MAX_SERVES_PER_CHUNK => {
                *alone += 1;
                true
            }
            _ => false,
        }
    }
}

/// The routes of the chunks of the payloads served since the last model was published (and
/// of onboarding packages, which are always sent to the site alone). Its memory is a few bytes
/// per chunk and site; [`Serving::clear`] frees it when a new model is published.
#[derive(Debug)]
pub struct Serving {
    payloads: BTreeMap<(u64, Payload), Sent>,
    expected: usize,
    gather_ms: u64,
    sharing: bool,
}

impl Serving {
    /// Gathers the first requests for a payload until `expected` sites have asked or for
    /// `gather_ms` after the first (0: decides at once).
    pub fn new(expected: usize, gather_ms: u64) -> Self {
        Serving {
            payloads: BTreeMap::new(),
            expected,
            gather_ms,
            sharing: true,
        }
    }

    /// Whether chunks may go on the topic every site reads (they go to each site alone while
    /// not: see the service's revocation list). Chunks shared before still count as shared.
    pub fn set_sharing(&mut self, sharing: bool) {
        self.sharing = sharing;
    }

    /// Forgets everything served (a new model version was published).
    pub fn clear(&mut self) {
        self.payloads.clear();
    }

    /// When the earliest gathering ends (ms), if any is under way.
    pub fn deadline(&self) -> Option<u64> {
        self.payloads
            .values()
            .filter_map(|s| s.gathering.as_ref().map(|g| g.0))
            .min()
    }

    /// What to send now of every gathering that is over at `now_ms` (its time is up, or every
    /// expected site asked): per payload, the chunks asked for, in index order, to every site
    /// when two or more sites asked and sharing is on, else to each site alone. They count as
    /// sent.
    pub fn due(&mut self, now_ms: u64) -> Vec<((u64, Payload), To, Vec<u32>)> {
        let (mut due, sharing) = (Vec::new(), self.sharing);
        for (&at, sent) in &mut self.payloads {
            let over = sent
                .gathering
                .as_ref()
                .is_some_and(|(until, _)| now_ms >= *until || sent.sites.len() >= self.expected);
            if !over {
                continue;
            }
            let (_, asked) = sent.gathering.take().expect("checked above");
            if sharing && asked.len() >= 2 {
                let all: BTreeSet<u32> = asked.into_values().flatten().collect();
                for &i in &all {
                    sent.seq += 1;
                    sent.shared[i as usize] = sent.seq;
                }
                due.push((at, To::All, all.into_iter().collect()));
            } else {
                for (site, indices) in asked {
                    let alone: Vec<u32> = indices
                        .into_iter()
                        .filter(|&i| sent.alone(&site, i as usize))
                        .collect();
                    due.push((at, To::Site(site), alone));
                }
            }
        }
        due
    }

    /// Routes chunk `index` of `n` of `payload` of model `version`, asked for by `site`
    /// (`missed`: it may have missed what was shared, see `ChunkRequest::alone`). Only
    /// `Payload::Model` and `Payload::Delta` are shared.
    pub fn route(
        &mut self,
        site: &Id,
        (version, payload): (u64, Payload),
        (index, n): (usize, usize),
        missed: bool,
        now_ms: u64,
    ) -> Route {
        let shareable = self.sharing && payload != Payload::Package;
        let gather_until =
            (shareable && self.gather_ms > 0).then(|| now_ms.saturating_add(self.gather_ms));
        let sent = self
            .payloads
            .entry((version, payload))
            .or_insert_with(|| Sent::new(n, gather_until));
        let seq = sent.seq;
        if !sent.sites.contains_key(site) {
            sent.sites
                .insert(site.clone(), (seq, vec![(0, 0); sent.shared.len()]));
        }
        let (since, asks) = sent.sites.get_mut(site).expect("present or just inserted");
        let Some((asked, _)) = asks.get_mut(index) else {
            return Route::Refused;
        };
        let first_ask = *asked == 0 && !missed;
        *asked = asked.saturating_add(1);
        // What is shared from now on reaches it (it asked after it reconnected).
        let heard_before = *since;
        if missed {
            *since = seq;
        }
        if let Some((_, gathered)) = sent.gathering.as_mut().filter(|_| shareable) {
            gathered
                .entry(site.clone())
                .or_default()
                .insert(index as u32);
            return Route::Gathered;
        }
        let shared_at = sent.shared[index];
        match shared_at {
            // Shared once a second site wants the payload.
            0 if shareable && sent.sites.len() >= 2 => {
                sent.seq += 1;
                sent.shared[index] = sent.seq;
                Route::Shared
            }
            at if at > heard_before && first_ask => Route::OnItsWay,
            _ if sent.alone(site, index) => Route::Site,
            _ => Route::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    fn routes(
        s: &mut Serving,
        site: &Id,
        at: (u64, Payload),
        idx: std::ops::Range<usize>,
    ) -> Vec<Route> {
        idx.map(|i| s.route(site, at, (i, 8), false, 0)).collect()
    }

    /// A serving where `a` and `b` have asked for chunk 7 of `at`: `a` alone got it, then
    /// it was shared when `b` wanted it too.
    fn two_asked(at: (u64, Payload)) -> (Serving, Id, Id) {
        let (a, b) = (id("a"), id("b"));
        let mut s = Serving::new(2, 0);
        assert_eq!(s.route(&a, at, (7, 8), false, 0), Route::Site);
        assert_eq!(s.route(&b, at, (7, 8), false, 0), Route::Shared);
        (s, a, b)
    }

    #[test]
    fn a_payload_one_site_wants_goes_to_it_alone_and_is_shared_once_a_second_wants_it() {
        let (a, b) = (id("a"), id("b"));
        let mut s = Serving::new(5, 0);
        let at = (3, Payload::Model);
        assert_eq!(routes(&mut s, &a, at, 0..2), vec![Route::Site; 2]);
        // Another payload of the version (the delta the others fetch) is unaffected.
        assert_eq!(
            s.route(&b, (3, Payload::Delta), (0, 8), false, 0),
            Route::Site
        );
        // b wants the model too: from now on it is shared, and a hears it.
        assert_eq!(routes(&mut s, &b, at, 0..4), vec![Route::Shared; 4]);
        assert_eq!(routes(&mut s, &a, at, 2..4), vec![Route::OnItsWay; 2]);
    }

    #[test]
    fn each_chunk_is_shared_once_and_a_site_listening_before_it_is_not_sent_it_again() {
        let at = (3, Payload::Model);
        let (mut s, a, b) = two_asked(at);
        assert_eq!(routes(&mut s, &b, at, 0..4), vec![Route::Shared; 4]);
        let c = id("c");
        assert_eq!(routes(&mut s, &c, at, 4..6), vec![Route::Shared; 2]);
        // a and b listened before 4..6 went out: they are on their way to them.
        assert_eq!(routes(&mut s, &a, at, 4..6), vec![Route::OnItsWay; 2]);
        assert_eq!(routes(&mut s, &b, at, 4..6), vec![Route::OnItsWay; 2]);
        // c first asked after 0..4 went out: it may have dropped them, so it gets its own.
        assert_eq!(routes(&mut s, &c, at, 0..4), vec![Route::Site; 4]);
        // b asks again for a chunk that was on its way: it was lost, so b gets its own.
        assert_eq!(s.route(&b, at, (5, 8), false, 0), Route::Site);
    }

    #[test]
    fn a_site_is_sent_a_chunk_alone_a_bounded_number_of_times() {
        let at = (1, Payload::Delta);
        let (mut s, a, b) = two_asked(at);
        assert_eq!(s.route(&a, at, (2, 8), false, 0), Route::Shared);
        // b listened: the first ask is on its way; asked again, b is sent it alone, 8 times.
        let alone: Vec<Route> = (0..11).map(|_| s.route(&b, at, (2, 8), false, 0)).collect();
        assert_eq!(alone[0], Route::OnItsWay);
        assert_eq!(alone[1..9], [Route::Site; 8]);
        assert_eq!(alone[9..], [Route::Refused; 2]);
        // Never shared twice, whoever asks.
        assert_eq!(s.route(&a, at, (2, 8), false, 0), Route::Site);
        // An index out of range is refused, not a panic.
        assert_eq!(s.route(&a, at, (8, 8), false, 0), Route::Refused);
    }

    #[test]
    fn packages_go_to_the_site_alone_and_a_cleared_serving_starts_afresh() {
        let (a, b) = (id("a"), id("b"));
        let mut s = Serving::new(2, 0);
        for site in [&a, &b] {
            assert_eq!(
                routes(&mut s, site, (2, Payload::Package), 0..2),
                vec![Route::Site; 2]
            );
        }
        let (mut s, a, _) = two_asked((2, Payload::Model));
        assert_eq!(
            s.route(&a, (2, Payload::Model), (0, 8), false, 0),
            Route::Shared
        );
        s.clear();
        assert_eq!(
            s.route(&a, (2, Payload::Model), (0, 8), false, 0),
            Route::Site
        );
    }

    #[test]
    fn first_requests_are_gathered_until_every_site_asked_or_the_time_is_up() {
        let (a, b, c) = (id("a"), id("b"), id("c"));
        let mut s = Serving::new(3, 20);
        let at = (5, Payload::Model);
        assert_eq!(routes(&mut s, &a, at, 0..4), vec![Route::Gathered; 4]);
        assert_eq!(s.deadline(), Some(20));
        assert_eq!(s.due(19), vec![]);
        assert_eq!(routes(&mut s, &b, at, 2..6), vec![Route::Gathered; 4]);
        assert_eq!(s.due(1), vec![]);
        // The third site asks: everything asked for is shared at once, in index order.
        assert_eq!(routes(&mut s, &c, at, 0..2), vec![Route::Gathered; 2]);
        assert_eq!(s.due(2), vec![(at, To::All, (0..6).collect())]);
        assert_eq!(s.deadline(), None);
        // All three listened before the first shared chunk: nothing is sent twice.
        assert_eq!(routes(&mut s, &c, at, 2..6), vec![Route::OnItsWay; 4]);
        assert_eq!(
            routes(&mut s, &a, at, 4..8),
            [
                Route::OnItsWay,
                Route::OnItsWay,
                Route::Shared,
                Route::Shared
            ]
        );
        // Under a time limit, a site that never asks holds the others up that long only; one
        // site alone is sent its chunks alone.
        let at = (5, Payload::Delta);
        assert_eq!(s.route(&a, at, (0, 8), false, 100), Route::Gathered);
        assert_eq!(s.due(119), vec![]);
        assert_eq!(s.due(120), vec![(at, To::Site(a.clone()), vec![0])]);
        // A package is never gathered.
        assert_eq!(
            s.route(&a, (5, Payload::Package), (0, 8), false, 200),
            Route::Site
        );
    }

    #[test]
    fn with_sharing_off_every_chunk_goes_to_its_site_alone_even_when_gathered() {
        let (a, b) = (id("a"), id("b"));
        let mut s = Serving::new(3, 20);
        let at = (1, Payload::Model);
        assert_eq!(routes(&mut s, &a, at, 0..2), vec![Route::Gathered; 2]);
        assert_eq!(routes(&mut s, &b, at, 1..3), vec![Route::Gathered; 2]);
        // Sharing stops while the first requests are gathered: each site gets what it asked.
        s.set_sharing(false);
        assert_eq!(
            s.due(20),
            vec![
                (at, To::Site(a.clone()), vec![0, 1]),
                (at, To::Site(b.clone()), vec![1, 2])
            ]
        );
        assert_eq!(routes(&mut s, &a, at, 2..4), vec![Route::Site; 2]);
        let at = (2, Payload::Model);
        assert_eq!(routes(&mut s, &a, at, 0..2), vec![Route::Site; 2]);
        assert_eq!(routes(&mut s, &b, at, 0..2), vec![Route::Site; 2]);
        assert_eq!(s.deadline(), None);
    }

    #[test]
    fn a_site_that_may_have_missed_shared_chunks_is_sent_them_alone_and_listens_again() {
        let at = (1, Payload::Model);
        let (mut s, a, b) = two_asked(at);
        assert_eq!(routes(&mut s, &b, at, 0..1), vec![Route::Shared]);
        // a reconnects while 1..4 go out (b's requests): its next request says so.
        assert_eq!(routes(&mut s, &b, at, 1..4), vec![Route::Shared; 3]);
        assert_eq!(s.route(&a, at, (0, 8), true, 0), Route::Site);
        // The rest of what went out before it reconnected comes alone too, whenever asked.
        assert_eq!(routes(&mut s, &a, at, 1..4), vec![Route::Site; 3]);
        // What is shared from its request on reaches it.
        assert_eq!(s.route(&b, at, (4, 8), false, 0), Route::Shared);
        assert_eq!(s.route(&a, at, (4, 8), false, 0), Route::OnItsWay);
    }
}
