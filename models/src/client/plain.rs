//! FedAvg's sites (also FedBN's, FedProx's, FedOpt's and FedNova's): plain cross-entropy or
//! FedProx's proximal term, which the objective's term prepares from the starting model alone.
//! Nothing is kept between rounds and nothing travels beside the delta.

use super::{ClientAlgorithm, ClientState};
use crate::zoo::Net;

/// The client of every algorithm that keeps no state on the site.
#[derive(Debug, Clone, Copy)]
pub struct Plain;

impl<N: Net> ClientAlgorithm<N> for Plain {
    fn adopt(&self, _held: ClientState) -> ClientState {
        ClientState::Stateless
    }
}
