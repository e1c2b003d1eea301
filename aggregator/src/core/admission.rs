//! Which site messages the core opens at all: signed by the site whose topic they came on, with
//! an enrolled, unrevoked key, for this federation.

use super::*;

/// Why a site's message was not admitted ([`Admission::admit`]); logged, never answered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdmitError {
    /// It does not decode, is not signed by an enrolled and unrevoked key, or its signature
    /// fails.
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// It is signed by another site than the one whose topic it came on.
    #[error("signed by `{signer}` but sent on the topic of `{topic}`")]
    WrongTopic {
        /// The signer.
        signer: String,
        /// The site whose topic it came on.
        topic: String,
    },
    /// It belongs to another run of the federation (a replay of an earlier run's message, or
    /// a site that follows another run).
    #[error("of run {got}, not this federation's run {want}")]
    OtherRun {
        /// The run it names.
        got: unifed_protocol::RunId,
        /// This federation's run.
        want: unifed_protocol::RunId,
    },
    /// It belongs to another federation.
    #[error("federation `{got}` is not `{want}`")]
    OtherFederation {
        /// The federation it names.
        got: String,
        /// This federation.
        want: String,
    },
}

/// The keys and federation a site's message is opened against ([`Aggregator::admission`]).
#[derive(Debug, Clone)]
pub struct Admission {
    pub(super) keyring: Keyring,
    federation: Id,
    run: unifed_protocol::RunId,
}

impl Admission {
    /// Opens messages of `federation` with the keys of `keyring`.
    pub fn new(keyring: Keyring, federation: Id) -> Self {
        Admission {
            keyring,
            federation,
            run: unifed_protocol::RunId::default(),
        }
    }

    /// These admissions, of messages of run `run` only.
    pub fn in_run(mut self, run: unifed_protocol::RunId) -> Self {
        self.run = run;
        self
    }

    /// Opens a message that arrived on the topic of `topic_site`: it must decode within
    /// `limit` bytes, be signed by that site's enrolled and unrevoked key, and belong to this
    /// federation. The error says why not, for the log.
    pub fn admit<'a>(
        &self,
        topic_site: &Id,
        bytes: &'a [u8],
        limit: usize,
    ) -> Result<EnvelopeRef<'a>, AdmitError> {
        let env = self.keyring.open(bytes, limit)?;
        self.belongs(topic_site, env)
    }

    /// [`Admission::admit`] of an update that came as a chunk set ([`Arrival::SignedChunks`]):
    /// every chunk was admitted from `topic_site`, so the envelope's own signature is not
    /// checked again ([`Keyring::open_signed_in_chunks`]); the rest is.
    pub fn admit_signed_in_chunks<'a>(
        &self,
        topic_site: &Id,
        bytes: &'a [u8],
        limit: usize,
    ) -> Result<EnvelopeRef<'a>, AdmitError> {
        let env = self.keyring.open_signed_in_chunks(bytes, limit)?;
        self.belongs(topic_site, env)
    }

    /// `env` if `topic_site` sent it and it is of this federation.
    fn belongs<'a>(
        &self,
        topic_site: &Id,
        env: EnvelopeRef<'a>,
    ) -> Result<EnvelopeRef<'a>, AdmitError> {
        if &env.sender != topic_site {
            return Err(AdmitError::WrongTopic {
                signer: env.sender.to_string(),
                topic: topic_site.to_string(),
            });
        }
        if env.federation != self.federation {
            return Err(AdmitError::OtherFederation {
                got: env.federation.to_string(),
                want: self.federation.to_string(),
            });
        }
        if env.run != self.run {
            return Err(AdmitError::OtherRun {
                got: env.run,
                want: self.run,
            });
        }
        Ok(env)
    }
}
