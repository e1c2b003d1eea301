//! Closing a round: the fold by the strategy over the spool, the checks before the commit point,
//! damaged spool files set aside, and the next round opened.

use super::*;

/// Why a combined model or strategy state is never committed (the round is discarded).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
enum Uncommittable {
    /// A tensor of the model holds NaN or infinity.
    #[error("`{tensor}` holds {value}")]
    NotFinite {
        /// The tensor.
        tensor: String,
        /// The value.
        value: f32,
    },
    /// A BN running variance holds a negative value.
    #[error("`{0}` holds a negative variance")]
    NegativeVariance(String),
    /// The strategy's state holds a value it may not.
    #[error(transparent)]
    State(#[from] StrategyError),
}

impl Aggregator {
    /// Combines the spool of the open round into the new model by the strategy, checks it,
    /// persists it and the state with the strategy's (the commit point), then opens the next
    /// round or finishes. A combined model with NaN, infinity or a negative variance, or a
    /// strategy state with NaN or infinity, is never committed: the round is discarded, and the
    /// current model and strategy state are committed again as the next version (so every site
    /// applies the global model again instead of training on from its own weights).
    pub(super) fn close_round(&mut self, now_ms: u64) -> Result<Vec<Action>, CoreError> {
        // Each update is read once, by the fold, whose result counts only if every file checked
        // out in full: a damaged one stops the fold, whatever it had summed is dropped, the
        // model and strategy go back to the committed ones, and the damaged updates are set
        // aside below before the fold runs again.
        match self.fold_round(now_ms) {
            Err(CoreError::Read(ReadError::Damaged { what, message })) => {
                tracing::warn!(
                    path = what,
                    message,
                    "a spooled update is damaged; checking every one before folding again"
                );
                self.restore_committed()?;
            }
            folded => return folded,
        }
        let round = self.state.round;
        let resend = self.set_aside_damaged(round, now_ms)?;
        if !resend.is_empty()
            && (self.accepted.is_empty()
                || (now_ms < self.state.deadline_ms && self.accepted.len() < self.needed()))
        {
            // Too few intact updates left: wait for the re-sends (or the deadline).
            return Ok(resend);
        }
        let mut actions = resend;
        actions.extend(self.fold_round(now_ms)?);
        Ok(actions)
    }

    /// Puts the committed model and strategy state of the current version back in place of
    /// whatever a fold made of them.
    fn restore_committed(&mut self) -> Result<(), CoreError> {
        self.model = Arc::new(
            self.store
                .load_model(self.state.model_version, &self.hash.0)?,
        );
        self.strategy =
            Self::committed_strategy(&self.store, &self.cfg, &self.setup, &self.state, &self.hash)
                .map_err(|d| d.at(self.store.dir()))?;
        Ok(())
    }

    /// Checks every spooled update of `round` in full before any is used. A damaged one
    /// (checksum, format, a value that is not finite) is moved out of the spool, audited, no
    /// longer counted, and its site asked to send its update again.
    fn set_aside_damaged(&mut self, round: u64, now_ms: u64) -> Result<Vec<Action>, CoreError> {
        let mut out = Vec::new();
        for site in self.store.spool_sites(round)? {
            match self.store.spool_check(round, &site) {
                Ok(()) => {}
                Err(StoreError::Corrupt { message, .. }) => {
                    let to = self.store.spool_quarantine(round, &site, now_ms)?;
                    tracing::error!(round, site, message, to = %to.display(), "damaged spool file set aside; asking the site to re-send");
                    self.audit(
                        now_ms,
                        round,
                        &site,
                        "spool-damaged",
                        format!("{message}; moved to {}", to.display()),
                    )?;
                    self.accepted.remove(&site);
                    if let Ok(id) = Id::new(&site) {
                        out.push(Action::Answer {
                            site: id,
                            round,
                            update_hash: [0; 32],
                            answer: Answer::Resend,
                        });
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Combines the (checked) spool of the open round into the next model version.
    fn fold_round(&mut self, now_ms: u64) -> Result<Vec<Action>, CoreError> {
        let round = self.state.round;
        let sites = self.store.spool_sites(round)?;
        let (weighting, bounds) = (self.cfg.weighting, self.cfg.cohort_bounds());
        // A footer that cannot be read is a damaged file, set aside as the fold's checks would.
        let vouched = |s: &str| self.cfg.vouched_count(s).is_some();
        let reader = SpoolRound::bounded(
            &self.store,
            round,
            (sites.clone(), vouched),
            weighting,
            bounds,
        )
        .map_err(ReadError::from)?;
        {
            let idx = &self.update_idx;
            let mut targets: Vec<&mut Vec<f32>> = Arc::make_mut(&mut self.model)
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| idx.contains(i))
                .map(|(_, t)| t)
                .collect();
            self.strategy.aggregate(&reader, &mut targets)?;
        }
        let next = self.strategy.state();
        let checked = self.check_model();
        let version = match checked.and_then(|()| Ok(next.check()?)) {
            Ok(()) => {
                let version = self.state.model_version + 1;
                self.store.save_model(version, &self.hash.0, &self.model)?;
                self.store.save_strategy(version, &self.hash.0, &next)?;
                self.pool_shared_bn(&reader, version)?;
                self.audit_bounded(now_ms, &reader)?;
                version
            }
            Err(problem) => {
                tracing::error!(round, %problem, "combined model refused; round discarded");
                self.audit(now_ms, round, "-", "round-discarded", problem.to_string())?;
                self.restore_committed()?;
                // ... re-published as a new version: the sites that trained in the discarded
                // round hold their own trained weights, and a new version makes every site
                // fetch and apply the global model again before it trains.
                let version = self.state.model_version + 1;
                self.store.save_model(version, &self.hash.0, &self.model)?;
                self.store
                    .save_strategy(version, &self.hash.0, &self.strategy.state())?;
                version
            }
        };
        self.advance_held(version)?;
        self.state.recent.push(ClosedRound {
            round,
            accepted: sites.clone(),
        });
        if self.state.recent.len() > RECENT_ROUNDS {
            self.state.recent.remove(0);
        }
        self.state.model_version = version;
        let mut actions = vec![Action::RoundClosed {
            round,
            sites: sites.clone(),
            model_version: version,
        }];
        self.accepted.clear();
        if round >= self.cfg.rounds {
            self.state.finished = true;
            self.store.save_state(&self.state)?;
            actions.push(self.publish());
            actions.push(Action::Finished {
                model_version: version,
            });
        } else {
            self.state.round = round + 1;
            self.open_round(now_ms)?;
            actions.push(self.publish());
        }
        self.store.prune_models(version, self.cfg.keep_versions)?;
        self.store.prune_registry(version, self.cfg.keep_versions)?;
        self.store
            .spool_clear_before(self.state.round.min(round + 1))?;
        self.audit(
            now_ms,
            round,
            "-",
            "round-closed",
            format!("{} updates -> model v{version}", sites.len()),
        )?;
        self.audit_suppressed(now_ms, round)?;
        Ok(actions)
    }

    /// Audits each update of the round whose weight or norm the cohort bounds cut, with what
    /// it claimed and what was counted, and says so in the log.
    fn audit_bounded(&self, now_ms: u64, reader: &SpoolRound<'_>) -> Result<(), CoreError> {
        let round = reader.round();
        for (site, t) in reader.sites().iter().zip(reader.takes()) {
            if !t.bounded() {
                continue;
            }
            let detail = format!(
                "weight counted as {} of {} claimed samples; delta scaled by {:.4} (norm {:.4e})",
                t.samples, t.claimed, t.scale, t.norm
            );
            tracing::warn!(
                round,
                site,
                detail,
                "update bounded relative to its round's cohort"
            );
            self.audit(now_ms, round, site, "bounded", detail)?;
        }
        Ok(())
    }

    /// Checks the model before it is committed: every value finite, every BN running variance
    /// non-negative. Names the first problem.
    fn check_model(&self) -> Result<(), Uncommittable> {
        for (t, v) in self.spec.tensors.iter().zip(self.model.iter()) {
            if let Some(&value) = v.iter().find(|x| !x.is_finite()) {
                let tensor = t.name.clone();
                return Err(Uncommittable::NotFinite { tensor, value });
            }
            if t.kind == TensorKind::BnRunningVar && v.iter().any(|&x| x < 0.0) {
                return Err(Uncommittable::NegativeVariance(t.name.clone()));
            }
        }
        Ok(())
    }

    /// Pools the BN tensors the sharing policy lets sites send into version `version`'s
    /// onboarding package (written before the commit point).
    fn pool_shared_bn(&self, reader: &dyn Contributions, version: u64) -> Result<(), CoreError> {
        if self.share_idx.is_empty() {
            return Ok(());
        }
        let mut shares: Vec<(f64, Vec<Vec<f32>>)> = Vec::new();
        let mut share_sites: Vec<String> = Vec::new();
        for c in reader.iter() {
            let (site, c) = c?;
            if c.bn.len() == self.share_idx.len() {
                shares.push((reader.weight(&c), c.bn));
                share_sites.push(site.to_string());
            }
        }
        if shares.is_empty() {
            return Ok(());
        }
        let specs: Vec<&TensorSpec> = self
            .share_idx
            .iter()
            .map(|&i| &self.spec.tensors[i])
            .collect();
        let pooled = bnshare::pool(&specs, &shares);
        self.store
            .save_bn_share(version, &self.hash.0, &share_sites, &pooled)?;
        Ok(())
    }
}
