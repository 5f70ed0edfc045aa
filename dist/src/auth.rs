//! Job authentication: the per-job secret, and the challenge–response that the rendezvous store
//! and every rank-to-rank connection run over it before trusting a byte.
//!
//! A job's ranks share a secret ([`JobSecret`]) that nobody else knows: `tandem-run` draws a
//! fresh one from the operating system's CSPRNG for every job and hands it to its ranks in the
//! environment variable [`SECRET_VAR`] (`TANDEM_JOB_SECRET`); under srun, mpirun or torchrun the
//! user exports the same value to every rank. Each new connection then runs a mutual
//! challenge–response: both ends send a fresh 32-byte random nonce, and each proves that it
//! knows the secret by sending HMAC-SHA256(secret, role label ‖ the whole handshake transcript,
//! both nonces included). A proof is bound to its connection (fresh nonces: no replay), to its
//! direction (the role label: a proof cannot be reflected back) and to everything both sides
//! said (ranks, world size, group), and the secret itself never crosses the network. A
//! connection whose proof is missing or wrong is closed and logged, never trusted.
//!
//! What this does not do: encrypt, or authenticate each later frame. Someone who can read the
//! traffic sees the gradients; someone who can inject packets into an established TCP
//! connection (on the path between two ranks) is not stopped. Run jobs on a network you control.
//!
//! Without a secret, a multi-process job is refused at [`init_from_env`](crate::init_from_env)
//! unless [`ALLOW_UNAUTHENTICATED_VAR`] (`TANDEM_ALLOW_UNAUTHENTICATED=1`) says that running
//! unauthenticated, as PyTorch does, is intended.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{DistError, Result};

/// The environment variable that carries the job secret to every rank.
pub const SECRET_VAR: &str = "TANDEM_JOB_SECRET";
/// Set to `1` to run a multi-process job without a secret (no authentication, as PyTorch).
pub const ALLOW_UNAUTHENTICATED_VAR: &str = "TANDEM_ALLOW_UNAUTHENTICATED";
/// Fewest characters a secret may have (a generated one has 64 hex digits, 256 bits).
pub const MIN_SECRET_LEN: usize = 16;
/// Most characters a secret may have.
pub const MAX_SECRET_LEN: usize = 1024;
/// Bytes of a handshake nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of a proof (HMAC-SHA256).
pub(crate) const PROOF_LEN: usize = 32;

/// A fresh handshake nonce.
pub(crate) type Nonce = [u8; NONCE_LEN];
/// A proof of knowing the secret.
pub(crate) type Proof = [u8; PROOF_LEN];

/// The secret a job's ranks share. Cheap to clone; its `Debug` output never shows it.
#[derive(Clone)]
pub struct JobSecret(Arc<str>);

impl JobSecret {
    /// A new random secret: 32 bytes from the operating system's CSPRNG, as 64 hex digits.
    pub fn generate() -> Result<Self> {
        let mut bytes = [0u8; 32];
        getrandom::getrandom(&mut bytes).map_err(|e| {
            let os = match e.raw_os_error() {
                Some(code) => std::io::Error::from_raw_os_error(code),
                None => std::io::Error::other(e.to_string()),
            };
            DistError::io("generating the job secret", os)
        })?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(JobSecret(hex.into()))
    }

    /// The secret given as `value` (what [`SECRET_VAR`] holds): any string of
    /// [`MIN_SECRET_LEN`] to [`MAX_SECRET_LEN`] characters; use a random one.
    pub fn from_value(value: &str) -> Result<Self> {
        let len = value.chars().count();
        if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&len) {
            return Err(DistError::env(
                SECRET_VAR,
                format!(
                    "has {len} characters; a job secret needs {MIN_SECRET_LEN} to \
                     {MAX_SECRET_LEN} (generate one with `openssl rand -hex 32`)"
                ),
            ));
        }
        Ok(JobSecret(value.into()))
    }

    /// The value to put in [`SECRET_VAR`] for the ranks.
    pub fn env_value(&self) -> &str {
        &self.0
    }

    /// The proof, under this secret, that the sender in `role` took part in the handshake whose
    /// fields are `parts`.
    pub(crate) fn prove(&self, role: &str, parts: &[&[u8]]) -> Proof {
        self.mac(role, parts).finalize().into_bytes().into()
    }

    /// Whether `proof` is the proof [`JobSecret::prove`] would give (compared in constant time).
    pub(crate) fn verify(&self, role: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(role, parts).verify_slice(proof).is_ok()
    }

    fn mac(&self, role: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
        // HMAC takes keys of any length, so this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.0.as_bytes())
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
        // Length-prefixed fields, so that no two different transcripts encode alike.
        for field in std::iter::once(role.as_bytes()).chain(parts.iter().copied()) {
            mac.update(&(field.len() as u64).to_le_bytes());
            mac.update(field);
        }
        mac
    }
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(<redacted>)")
    }
}

impl PartialEq for JobSecret {
    fn eq(&self, other: &Self) -> bool {
        // Constant time in the contents: compare through the MAC of a fixed message.
        let probe = other.prove("compare", &[]);
        self.verify("compare", &[], &probe)
    }
}

impl Eq for JobSecret {}

/// A fresh random nonce from the operating system's CSPRNG.
pub(crate) fn nonce() -> std::io::Result<Nonce> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(std::io::Error::other)?;
    Ok(n)
}

/// Reads the job secret a rank was given, from an environment map: `Ok(None)` when
/// [`SECRET_VAR`] is unset (or empty).
pub(crate) fn secret_from_map(
    env: &std::collections::HashMap<String, String>,
) -> Result<Option<JobSecret>> {
    match env.get(SECRET_VAR).map(|v| v.trim()) {
        None | Some("") => Ok(None),
        Some(v) => JobSecret::from_value(v).map(Some),
    }
}

/// Whether [`ALLOW_UNAUTHENTICATED_VAR`] is set to `1` in `env`; any other value but unset,
/// empty or `0` is an error.
pub(crate) fn unauthenticated_allowed(
    env: &std::collections::HashMap<String, String>,
) -> Result<bool> {
    match env.get(ALLOW_UNAUTHENTICATED_VAR).map(|v| v.trim()) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(DistError::env(
            ALLOW_UNAUTHENTICATED_VAR,
            format!("{other:?} is not 0 or 1"),
        )),
    }
}

/// The secret a launcher hands to the ranks of a job of `nnodes` nodes: the one in its own
/// environment if set; else a fresh random one for a single-node job; else (several nodes,
/// whose launchers cannot agree on a random secret) an error, unless unauthenticated runs are
/// allowed, which gives `None`.
pub fn launcher_secret(nnodes: usize) -> Result<Option<JobSecret>> {
    let env: std::collections::HashMap<String, String> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    if let Some(secret) = secret_from_map(&env)? {
        return Ok(Some(secret));
    }
    if unauthenticated_allowed(&env)? {
        return Ok(None);
    }
    if nnodes == 1 {
        return JobSecret::generate().map(Some);
    }
    Err(DistError::Launch(format!(
        "a job of {nnodes} nodes needs the same secret on every node: set {SECRET_VAR} to one \
         random value (for example `export {SECRET_VAR}=$(openssl rand -hex 32)`) wherever \
         tandem-run starts, or set {ALLOW_UNAUTHENTICATED_VAR}=1 to run without authentication \
         on a network you trust"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_secret_role_and_every_field() {
        let a = JobSecret::from_value("0123456789abcdef0123").unwrap();
        let b = JobSecret::from_value("0123456789abcdef0124").unwrap();
        let p = a.prove("client", &[b"nonce-1", b"nonce-2"]);
        assert!(a.verify("client", &[b"nonce-1", b"nonce-2"], &p));
        assert!(!b.verify("client", &[b"nonce-1", b"nonce-2"], &p));
        assert!(!a.verify("server", &[b"nonce-1", b"nonce-2"], &p));
        assert!(!a.verify("client", &[b"nonce-1", b"nonce-3"], &p));
        // Field boundaries count: ("ab", "c") is not ("a", "bc").
        assert!(!a.verify("client", &[b"nonce-1n", b"once-2"], &p));
        assert!(!a.verify("client", &[b"nonce-1", b"nonce-2"], &p[..31]));
        // An independent HMAC-SHA256 (RFC 4231 test case 2) checks the primitive itself.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let hex: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn generated_secrets_are_long_random_and_never_printed() {
        let a = JobSecret::generate().unwrap();
        let b = JobSecret::generate().unwrap();
        assert_eq!(a.env_value().len(), 64);
        assert_ne!(a, b);
        assert_eq!(a, JobSecret::from_value(a.env_value()).unwrap());
        assert!(!format!("{a:?}").contains(a.env_value()));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn a_launcher_generates_a_secret_for_one_node_and_requires_one_for_several() {
        if std::env::var_os(SECRET_VAR).is_some()
            || std::env::var_os(ALLOW_UNAUTHENTICATED_VAR).is_some()
        {
            return; // the environment decides; nothing to check here
        }
        let one = launcher_secret(1).unwrap().unwrap();
        assert_eq!(one.env_value().len(), 64);
        let err = launcher_secret(2).unwrap_err().to_string();
        assert!(
            err.contains(SECRET_VAR) && err.contains(ALLOW_UNAUTHENTICATED_VAR),
            "{err}"
        );
    }

    #[test]
    fn short_secrets_and_bad_switches_are_refused_naming_the_variable() {
        let err = JobSecret::from_value("short").unwrap_err().to_string();
        assert!(err.contains(SECRET_VAR) && err.contains("16"), "{err}");
        let env = [(ALLOW_UNAUTHENTICATED_VAR.to_string(), "yes".to_string())].into();
        let err = unauthenticated_allowed(&env).unwrap_err().to_string();
        assert!(err.contains(ALLOW_UNAUTHENTICATED_VAR), "{err}");
    }
}
