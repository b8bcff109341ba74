use std::process::ExitCode;

use clap::Parser;
use traffic_policy_operator::cli::{Cli, Command};
use traffic_policy_operator::{api, coordination, manager};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Crd) => {
            print!("{}", api::crd_yaml());
            Ok(())
        }
        Some(Command::Shards { kubeconfig, namespace }) => {
            async {
                let client = manager::client(kubeconfig.as_deref()).await?;
                coordination::shards_report::print(client, &namespace).await
            }
            .await
        }
        None => manager::run(cli.run).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("traffic-policy-operator: {error:#}");
            ExitCode::FAILURE
        }
    }
}
