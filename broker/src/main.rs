//! `unifed-broker`: the embedded MQTT broker as a process of its own (see the library docs).

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "unifed-broker",
    about = "Embedded MQTT broker for UniFed Edge (rumqttd)"
)]
struct Cli {
    #[command(flatten)]
    broker: unifed_broker::BrokerArgs,
}

/// Large blocks in transparent huge pages (see `unifed_net::memory::HugeBlocks`).
#[global_allocator]
static ALLOCATOR: unifed_net::memory::HugeBlocks = unifed_net::memory::HugeBlocks;

fn main() -> anyhow::Result<()> {
    unifed_net::init_logging(unifed_broker::LOG_FILTER);
    unifed_broker::run(&Cli::parse().broker)
}
