//! Shared by the `loadtest` tool and the `kube-rs-peer` binary.

pub mod writes;
