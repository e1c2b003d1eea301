//! Taking updates: admission, the core's checks of names, shapes, encodings and norms, the
//! strategy's checks, the spool, and the answer.

use super::*;

impl Aggregator {
    fn reject(
        &mut self,
        now_ms: u64,
        to: &To,
        reason: RejectReason,
    ) -> Result<Vec<Action>, CoreError> {
        let (site, round) = (&to.site, to.round);
        tracing::info!(site = %site, round, ?reason, "update rejected");
        let detail = format!("{reason:?}");
        self.audit_refusal(now_ms, round, site.as_str(), "rejected", detail)?;
        Ok(vec![to.answer(Answer::Rejected(reason))])
    }

    /// Checks, spools and answers updates that arrived together, in their order, then asks for
    /// the round to be closed if it has every update it needs. The updates are taken in waves
    /// of at most [`VET_WIDTH`] different sites: each wave's checks of the round's state run
    /// one after the other, its updates' value checks and spool files (the slow part, tens of
    /// milliseconds each) side by side, and its accepts again in order. Each model-sized form of
    /// an update (the message, the encoded update, the dense delta) is let go as soon as its
    /// spool file is written, and a wave's messages before the next wave is read.
    pub(super) fn on_updates(
        &mut self,
        batch: Vec<Incoming>,
        now_ms: u64,
    ) -> Result<Vec<Action>, CoreError> {
        let width = crate::threads_up_to(VET_WIDTH);
        let mut actions = Vec::new();
        let mut batch = batch.into_iter().peekable();
        while batch.peek().is_some() {
            // A site's second update waits for the next wave: its spool file has one name.
            let mut wave: Vec<Incoming> = Vec::new();
            while let Some(u) =
                batch.next_if(|u| wave.len() < width && wave.iter().all(|w| w.site != u.site))
            {
                wave.push(u);
            }
            actions.extend(self.take_wave(&wave, now_ms)?);
        }
        if self.round_complete() {
            actions.push(Action::Close);
        }
        Ok(actions)
    }

    /// One wave of [`Aggregator::on_updates`]: updates of different sites, so that none of
    /// them depends on another's answer.
    fn take_wave(&mut self, wave: &[Incoming], now_ms: u64) -> Result<Vec<Action>, CoreError> {
        let admitted: Vec<_> = wave.iter().map(|u| self.admit_update(u)).collect();
        let this: &Self = self;
        let vet = |a: &Result<Admitted<'_>, Box<Refused>>, u: &Incoming| {
            a.as_ref().ok().map(|a| this.vet(a, u.staged.as_deref()))
        };
        let vetted: Vec<_> = if admitted.iter().filter(|a| a.is_ok()).count() < 2 {
            admitted.iter().zip(wave).map(|(a, u)| vet(a, u)).collect()
        } else {
            std::thread::scope(|s| {
                let jobs: Vec<_> = admitted
                    .iter()
                    .zip(wave)
                    .map(|(a, u)| s.spawn(move || vet(a, u)))
                    .collect();
                jobs.into_iter()
                    .map(|j| j.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            })
        };
        // Answered (and audited) in arrival order, as one by one.
        let mut actions = Vec::new();
        for (a, v) in admitted.into_iter().zip(vetted) {
            actions.extend(match (a, v) {
                (Err(refused), _) => self.refuse(*refused, now_ms)?,
                (Ok(a), Some(v)) => match v? {
                    Ok(v) => self.accept(a, v, now_ms)?,
                    Err(reason) => self.reject(now_ms, &a.to, reason)?,
                },
                (Ok(_), None) => unreachable!("every admitted update is vetted"),
            });
        }
        Ok(actions)
    }

    /// The checks of an update against the round's state (sender, kind, spec, round, model
    /// version, sampling, sample count): `Ok` with the update read in place (its tensors' bytes
    /// stay where they arrived), or why it is not taken further.
    fn admit_update<'b>(&self, u: &'b Incoming) -> Result<Admitted<'b>, Box<Refused>> {
        let Ok(site) = Id::new(&u.site) else {
            tracing::warn!(
                site = u.site,
                "update on a topic with an invalid site id; dropped"
            );
            return Err(Box::new(Refused::Dropped));
        };
        let bytes = &u.bytes;
        let open = self.state.round;
        // Every answer names the bytes it answers, so a site never takes another message's
        // answer (a reject of someone's garbage on its topic) for its own update's.
        let limit = self.cfg.max_update_bytes;
        let (hash, opened) = match u.arrival {
            Arrival::Message => (
                payload_hash(bytes),
                self.admission.admit(&site, bytes, limit),
            ),
            Arrival::SignedChunks { hash } => (
                hash,
                self.admission.admit_signed_in_chunks(&site, bytes, limit),
            ),
        };
        let env = match opened {
            Ok(e) => e,
            Err(why) => {
                // Not answered: only the site's own signed bytes earn an answer, and junk must
                // not make the aggregator publish or write anything.
                tracing::warn!(site = %site, "update refused: {why}");
                return Err(Box::new(Refused::Dropped));
            }
        };
        let to = |round| To {
            site: site.clone(),
            hash,
            round,
        };
        let reject = |round, reason| Err(Box::new(Refused::Rejected(to(round), reason)));
        if env.kind != MessageKind::SiteUpdate {
            let why = format!("message kind {:?} where an update was expected", env.kind);
            return reject(open, RejectReason::Malformed(why));
        }
        if env.spec_hash != self.hash {
            return reject(env.round, RejectReason::SpecHashMismatch);
        }
        let upd: SiteUpdateRef = match env.payload_as() {
            Ok(u) => u,
            Err(e) => return reject(env.round, RejectReason::Malformed(e.to_string())),
        };
        let round = upd.round;
        if round != env.round {
            let why = "envelope and update name different rounds".into();
            return reject(round, RejectReason::Malformed(why));
        }
        let duplicate = |detail| Err(Box::new(Refused::Duplicate(to(round), detail)));
        // Re-sends: the original answer, counted once.
        if let Some(refused) = self.closed_round_answer(to(round)) {
            return Err(Box::new(refused));
        }
        if round > open || open == 0 {
            let wrong = RejectReason::WrongRound {
                expected: open,
                got: round,
            };
            return reject(round, wrong);
        }
        if self.accepted.contains(site.as_str()) {
            return duplicate("re-send in its round");
        }
        if !self.state.sampled.is_empty() && !self.state.sampled.iter().any(|s| s == site.as_str())
        {
            return reject(round, RejectReason::NotSampled);
        }
        if upd.base_version != self.state.model_version
            || env.model_version != self.state.model_version
        {
            let wrong = RejectReason::WrongModelVersion {
                expected: self.state.model_version,
                got: upd.base_version,
            };
            return reject(round, wrong);
        }
        if upd.samples == 0 {
            return reject(round, RejectReason::NoSamples);
        }
        let max_samples = self.cfg.max_samples_of(site.as_str());
        if upd.samples > max_samples {
            let many = RejectReason::TooManySamples {
                samples: upd.samples,
                bound: max_samples,
            };
            return reject(round, many);
        }
        Ok(Admitted {
            to: to(round),
            message: bytes,
            update: upd,
        })
    }

    /// Answers a re-send of `to`'s update of a round that has closed ([`Event::Resent`]);
    /// nothing for a round that has not.
    pub(super) fn on_resent(&mut self, to: To, now_ms: u64) -> Result<Vec<Action>, CoreError> {
        match self.closed_round_answer(to) {
            Some(refused) => self.refuse(refused, now_ms),
            None => Ok(Vec::new()),
        }
    }

    /// The answer to a re-send of `to`'s update of a round that has closed: accepted (a
    /// duplicate) when the site's update was folded into it, `RoundClosed` when not or when
    /// the round is older than the record kept; `None` when its round has not closed.
    fn closed_round_answer(&self, to: To) -> Option<Refused> {
        let (open, round) = (self.state.round, to.round);
        if !(round < open || (round == open && self.state.finished)) {
            return None;
        }
        let was_accepted = self
            .state
            .recent
            .iter()
            .any(|c| c.round == round && c.accepted.iter().any(|s| s == to.site.as_str()));
        Some(if was_accepted {
            Refused::Duplicate(to, "re-send after its round closed")
        } else {
            Refused::Rejected(to, RejectReason::RoundClosed(round))
        })
    }

    /// Answers (and audits) an update [`Aggregator::admit_update`] did not take.
    fn refuse(&mut self, refused: Refused, now_ms: u64) -> Result<Vec<Action>, CoreError> {
        match refused {
            Refused::Dropped => Ok(Vec::new()),
            Refused::Rejected(to, reason) => self.reject(now_ms, &to, reason),
            Refused::Duplicate(to, detail) => {
                let site = to.site.as_str();
                self.audit_refusal(now_ms, to.round, site, "duplicate", detail.into())?;
                Ok(vec![to.answer(Answer::Accepted)])
            }
        }
    }

    /// The value checks of an admitted update (encodings, finite values, variances, norm, the
    /// strategy's own) and its spool file, written and synced but not yet in the spool: `Err`
    /// with the reason it is refused. Reads the core only, so several run side by side.
    fn vet(
        &self,
        a: &Admitted<'_>,
        staged: Option<&Path>,
    ) -> Result<Result<Vetted, RejectReason>, CoreError> {
        let upd = &a.update;
        let (checked, bn, norm) = match self.validate_delta(upd) {
            Ok(d) => d,
            Err(reason) => return Ok(Err(reason)),
        };
        let extras = match self.strategy.check(upd) {
            Ok(x) => x,
            Err(reason) => return Ok(Err(reason)),
        };
        // Every tensor is spooled as it arrived: an exact one as its values (the bytes it came
        // in, which are the spool's), a lossy one in its wire form (compact; the fold decodes
        // it again). Its decoded values, needed only for the checks, go now.
        let delta: Vec<SpoolTensor> = self
            .update_idx
            .iter()
            .zip(checked)
            .map(|(&i, c)| match c {
                Checked::Exact(bytes) => SpoolTensor::Le(bytes),
                Checked::Decoded(_) => {
                    let name = &self.spec.tensors[i].name;
                    SpoolTensor::Wire(
                        upd.delta
                            .iter()
                            .find(|t| &t.name == name)
                            .expect("a checked tensor is one of the update's"),
                    )
                }
            })
            .collect();
        if let Err((free_bytes, floor_bytes)) = self.disk_room() {
            tracing::error!(
                site = %a.to.site,
                free_bytes,
                floor_bytes,
                "update refused: the data disk is below its free-space floor; make room"
            );
            return Ok(Err(RejectReason::StorageFull {
                free_bytes,
                floor_bytes,
            }));
        }
        let entry = SpoolEntry {
            message: a.message,
            staged,
            samples: upd.samples,
            norm,
            report: &upd.report,
            extras: &extras,
            delta: &delta,
            bn: &bn,
        };
        // Durable first (the accept puts it in the spool).
        let sealed = self
            .store
            .spool_seal(a.to.round, a.to.site.as_str(), &entry)?;
        let ratio = norm / self.model_norm().max(1.0);
        Ok(Ok(Vetted { sealed, ratio }))
    }

    /// Puts a vetted update in the spool and accepts it.
    fn accept(
        &mut self,
        a: Admitted<'_>,
        v: Vetted,
        now_ms: u64,
    ) -> Result<Vec<Action>, CoreError> {
        self.store.spool_commit(v.sealed)?;
        let detail = format!(
            "{} samples, update norm {:.4} of the model's",
            a.update.samples, v.ratio
        );
        let to = a.to;
        self.audit(now_ms, to.round, to.site.as_str(), "accepted", detail)?;
        self.accepted.insert(to.site.as_str().to_string());
        Ok(vec![to.answer(Answer::Accepted)])
    }

    /// The L2 norm of the current model over the tensors updates carry (what
    /// `max_relative_norm` is relative to).
    fn model_norm(&self) -> f64 {
        let v = self.state.model_version;
        let mut cached = self.model_norm.lock().unwrap_or_else(|p| p.into_inner());
        match *cached {
            Some((at, n)) if at == v => n,
            _ => {
                let n = l2(self
                    .update_idx
                    .iter()
                    .map(|&i| sum_squares(self.model[i].iter().copied())));
                *cached = Some((v, n));
                n
            }
        }
    }

    /// Checks an update's tensors against the spec and policy; returns its deltas in
    /// `update_idx` order (exact ones read in place, lossy ones decoded), its shared BN tensors
    /// in `share_idx` order, and its L2 norm (at most `max_relative_norm` times the model's).
    #[allow(clippy::type_complexity)]
    fn validate_delta<'u>(
        &self,
        upd: &'u SiteUpdateRef<'_>,
    ) -> Result<(Vec<Checked<'u>>, Vec<Vec<f32>>, f64), RejectReason> {
        let delta = self.checked(&upd.delta, &self.update_idx, self.cfg.encoding)?;
        // Under `global` BN a running variance must stay a variance: base + delta >= 0.
        for (&i, d) in self.update_idx.iter().zip(&delta) {
            let spec = &self.spec.tensors[i];
            if spec.kind == TensorKind::BnRunningVar
                && self.model[i]
                    .iter()
                    .zip(d.values())
                    .any(|(&b, x)| (b as f64) + (x as f64) < 0.0)
            {
                return Err(RejectReason::NegativeVariance(spec.name.clone()));
            }
        }
        let norm = l2(delta.iter().map(Checked::sum_squares));
        let model_norm = self.model_norm();
        // A model of all zeros still lets updates of norm up to the ratio through.
        let relative = self.cfg.max_relative_norm * model_norm.max(1.0);
        let bound = self.cfg.norm_bound.map_or(relative, |b| b.min(relative));
        if norm > bound {
            return Err(RejectReason::NormTooLarge { norm, bound });
        }
        let share: Vec<Vec<f32>> = self
            .checked(&upd.bn, &self.share_idx, Encoding::F32)?
            .into_iter()
            .map(Checked::into_vec)
            .collect();
        for (&i, t) in self.share_idx.iter().zip(&share) {
            let spec = &self.spec.tensors[i];
            if spec.kind == TensorKind::BnRunningVar && t.iter().any(|&v| v < 0.0) {
                return Err(RejectReason::Malformed(format!(
                    "`{}` holds a negative variance",
                    spec.name
                )));
            }
        }
        Ok((delta, share, norm))
    }

    /// Checks `tensors` in the order of the spec indices `idx` (see [`strategy::checked`]).
    fn checked<'u, B: AsRef<[u8]>>(
        &self,
        tensors: &'u [EncodedTensor<B>],
        idx: &[usize],
        encoding: Encoding,
    ) -> Result<Vec<Checked<'u>>, RejectReason> {
        let specs: Vec<&TensorSpec> = idx.iter().map(|&i| &self.spec.tensors[i]).collect();
        strategy::checked(&specs, tensors, encoding)
    }
}
