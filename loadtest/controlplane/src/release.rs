//! Which Kubernetes the test bed runs: the version the suites run by default, or the oldest
//! the operator supports. Each is pinned by a go.mod of its own next to `build.sh` and built
//! into a cache directory keyed by its version.

use std::path::PathBuf;

use anyhow::Result;

use crate::tools::{Built, built_once};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Release {
    /// `kubernetes/go.mod`: what every suite runs unless told otherwise.
    #[default]
    Current,
    /// `kubernetes-oldest/go.mod`: the oldest minor the operator supports (docs/operations.md,
    /// "Kubernetes versions"). It has neither shard selectors nor MutatingAdmissionPolicy.
    Oldest,
}

impl Release {
    /// The release the suites run: `TPO_TEST_KUBERNETES=oldest` picks the oldest supported.
    pub fn of_tests() -> Self {
        match std::env::var("TPO_TEST_KUBERNETES").as_deref() {
            Ok("oldest") => Self::Oldest,
            Ok("") | Err(_) => Self::Current,
            Ok(other) => panic!("TPO_TEST_KUBERNETES={other}: expected \"oldest\" or nothing"),
        }
    }

    /// The kube-apiserver's `gitVersion`, as its go.mod pins it (`build.sh` reads it from
    /// there; the control-plane test checks that the two agree).
    pub fn version(self) -> &'static str {
        match self {
            Self::Current => "v1.36.3",
            Self::Oldest => "v1.32.13",
        }
    }

    /// Whether kube-apiserver has the alpha gate for shard selectors (KEP-5866).
    pub fn has_shard_selectors(self) -> bool {
        self == Self::Current
    }

    /// Whether it serves `admissionregistration.k8s.io/v1` MutatingAdmissionPolicy (GA in 1.36),
    /// which the bucket-labels component needs.
    pub fn has_mutating_admission_policy(self) -> bool {
        self == Self::Current
    }

    /// Whether NetworkPolicy validation refuses a CIDR with host bits set (`10.0.0.1/8`), which
    /// the policy CRD's `isCIDR` rule lets through: v1.32 accepts it.
    pub fn refuses_cidr_host_bits(self) -> bool {
        self == Self::Current
    }

    /// Whether a CRD's CEL rule failure names the offending value; older servers name its type.
    pub fn names_the_invalid_value(self) -> bool {
        self == Self::Current
    }

    /// Runs `build.sh` for this release once per process (it builds whatever is missing) and
    /// returns the bin dir. For the current release, `TPO_CONTROLPLANE_BIN_DIR` points at
    /// prebuilt binaries instead (a build with symbols, for profiles); the oldest is always
    /// the one `build.sh oldest` pins, so that the capabilities above hold.
    pub fn binaries(self) -> Result<PathBuf> {
        static CURRENT: Built = Built::new();
        static OLDEST: Built = Built::new();
        match self {
            Self::Current => match std::env::var_os("TPO_CONTROLPLANE_BIN_DIR") {
                Some(dir) => Ok(PathBuf::from(dir)),
                None => built_once(&CURRENT, "build.sh", &[], "controlplane"),
            },
            Self::Oldest => built_once(&OLDEST, "build.sh", &["oldest"], "controlplane (oldest)"),
        }
    }
}
