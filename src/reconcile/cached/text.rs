//! Texts kept small: the API server's tokens (uid, resourceVersion) and CIDRs as the
//! numbers they nearly always are, and texts many policies share held once. Each reads
//! back exactly as it was written.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::fmt;
use std::hash::Hash;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, LazyLock, Mutex};

/// A token the API server issues: a uid (a UUID, in 16 bytes) or a resourceVersion (a
/// decimal, in 8). Both are opaque by contract, so any other text is kept as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Token {
    Uuid([u8; 16]),
    Decimal(u64),
    Text(Box<str>),
}

impl Token {
    pub fn new(text: &str) -> Self {
        if let Some(uuid) = parse_uuid(text) {
            return Token::Uuid(uuid);
        }
        match canonical_decimal(text) {
            Some(number) => Token::Decimal(number),
            None => Token::Text(text.into()),
        }
    }

    /// Whether this is the token `text` (without allocating for the usual forms).
    pub fn is(&self, text: &str) -> bool {
        match self {
            Token::Uuid(uuid) => parse_uuid(text).as_ref() == Some(uuid),
            Token::Decimal(number) => canonical_decimal(text) == Some(*number),
            Token::Text(own) => **own == *text,
        }
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Uuid(uuid) => {
                for (i, byte) in uuid.iter().enumerate() {
                    if matches!(i, 4 | 6 | 8 | 10) {
                        f.write_str("-")?;
                    }
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
            Token::Decimal(number) => write!(f, "{number}"),
            Token::Text(text) => f.write_str(text),
        }
    }
}

/// A decimal written as a u64 writes it: digits only, no leading zero.
fn canonical_decimal(text: &str) -> Option<u64> {
    let canonical = text.bytes().all(|c| c.is_ascii_digit()) && (text == "0" || !text.starts_with('0'));
    if canonical { text.parse().ok() } else { None }
}

/// A UUID in its canonical form (lowercase, hyphenated), which is how the API server writes uids.
fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let bytes = text.as_bytes();
    if bytes.len() != 36 || [8, 13, 18, 23].iter().any(|&i| bytes[i] != b'-') {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut digits = bytes.iter().filter(|&&c| c != b'-');
    let mut uuid = [0; 16];
    for byte in &mut uuid {
        *byte = nibble(*digits.next()?)? << 4 | nibble(*digits.next()?)?;
    }
    Some(uuid)
}

/// A CIDR as its address and prefix length, when it reads back exactly as written
/// (`10.0.0.0/8`, `fd00::/8`); any other text is kept as it is.
#[derive(Clone, Debug, PartialEq)]
pub enum CidrRange {
    V4([u8; 4], u8),
    V6([u8; 16], u8),
    Text(Box<str>),
}

impl CidrRange {
    pub fn new(text: &str) -> Self {
        let parsed = text.split_once('/').and_then(|(address, prefix)| {
            let prefix: u8 = prefix.parse().ok()?;
            match address.parse().ok()? {
                IpAddr::V4(address) => Some(CidrRange::V4(address.octets(), prefix)),
                IpAddr::V6(address) => Some(CidrRange::V6(address.octets(), prefix)),
            }
        });
        match parsed {
            Some(range) if range.to_string() == text => range,
            _ => CidrRange::Text(text.into()),
        }
    }
}

impl std::fmt::Display for CidrRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CidrRange::V4(address, prefix) => write!(f, "{}/{prefix}", Ipv4Addr::from(*address)),
            CidrRange::V6(address, prefix) => write!(f, "{}/{prefix}", Ipv6Addr::from(*address)),
            CidrRange::Text(text) => f.write_str(text),
        }
    }
}

/// How many distinct values a [`Shared`] set holds: enough for every label key and
/// condition a cluster uses, and a bound on what unusual values can cost.
const SHARED_VALUES: usize = 1024;

/// Values many policies have (label keys, conditions), each held once. When the set is
/// full, it lets go of the values no policy holds any more (one-off error messages of
/// policies since fixed, deleted or handed off); past [`SHARED_VALUES`] values in use, a new
/// value gets an allocation of its own, as it would without the set.
pub struct Shared<T: ?Sized>(LazyLock<Mutex<HashSet<Arc<T>>>>);

impl<T: ?Sized + Hash + Eq> Shared<T> {
    pub const fn new() -> Self {
        Self(LazyLock::new(Mutex::default))
    }

    /// `value`, held once: the one held already, or else `own()`, which must equal it.
    pub fn get<Q: ?Sized + Hash + Eq>(&self, value: &Q, own: impl FnOnce() -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
    {
        let mut held = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(held) = held.get(value) {
            return held.clone();
        }
        let value = own();
        if held.len() >= SHARED_VALUES {
            held.retain(|value| Arc::strong_count(value) > 1);
        }
        if held.len() < SHARED_VALUES {
            held.insert(value.clone());
        }
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_read_back_as_written() {
        for text in [
            "0b6e2a8c-4f0e-4d55-9a3b-8d1f0c2e7a91",
            "123456",
            "0",
            "0042",
            "+1",
            "0B6E2A8C-4F0E-4D55-9A3B-8D1F0C2E7A91",
            "x",
            "",
        ] {
            let token = Token::new(text);
            assert_eq!(token.to_string(), text);
            assert!(token.is(text), "{text}");
        }
        assert!(matches!(Token::new("0b6e2a8c-4f0e-4d55-9a3b-8d1f0c2e7a91"), Token::Uuid(_)));
        assert!(matches!(Token::new("123456"), Token::Decimal(123456)));
        assert!(!Token::new("42").is("042") && !Token::new("42").is("+42") && !Token::new("42").is("43"));
        assert!(!Token::new("0").is("00"));
        let uuid = Token::new("0b6e2a8c-4f0e-4d55-9a3b-8d1f0c2e7a91");
        assert!(!uuid.is("0B6E2A8C-4F0E-4D55-9A3B-8D1F0C2E7A91"), "another text is another token");
    }

    #[test]
    fn a_shared_value_is_held_once_and_let_go_when_unused() {
        let set = Shared::<str>::new();
        let get = |text: &str| set.get(text, || text.into());
        let (a, b) = (get("app"), get("app"));
        assert!(Arc::ptr_eq(&a, &b));
        // Values in use fill the set: past the bound, a value is not shared.
        let in_use: Vec<Arc<str>> = (1..SHARED_VALUES).map(|n| get(&n.to_string())).collect();
        let (c, d) = (get("past the bound"), get("past the bound"));
        assert!(!Arc::ptr_eq(&c, &d) && c == d);
        // Values no one holds any more make room.
        drop(in_use);
        let (e, f) = (get("room again"), get("room again"));
        assert!(Arc::ptr_eq(&e, &f));
        assert!(Arc::ptr_eq(&a, &get("app")), "a value in use stays");
    }

    #[test]
    fn ranges_read_back_as_written() {
        for text in [
            "10.0.0.0/8",
            "fd00::/8",
            "10.0.0.1/8",
            "::ffff:10.0.0.0/104",
            "010.0.0.0/8",
            "FD00::/8",
            "10.0.0.0",
            "10.0.0.0/08",
        ] {
            assert_eq!(CidrRange::new(text).to_string(), text);
        }
        assert!(matches!(CidrRange::new("10.96.0.0/12"), CidrRange::V4([10, 96, 0, 0], 12)));
        assert!(matches!(CidrRange::new("fd00::/8"), CidrRange::V6(_, 8)));
        assert!(matches!(CidrRange::new("FD00::/8"), CidrRange::Text(_)));
    }
}
