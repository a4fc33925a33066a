//! Who a request is for: its [`Tenant`], in smg's canonical keys, and the tenant API keys
//! (`--tenant-api-key ID:KEY`) that name one.
//!
//! The keys, as smg spells them: `auth:<id>` for a caller who proved who they are (a tenant
//! key, the client key, a JWT's subject), `header:<id>` from a trusted tenant header (or, in
//! endpoint-picker mode, GIE's fairness id), `ip:<address>` from the connection's peer, and
//! `anonymous` otherwise.

use std::net::IpAddr;
use std::sync::Arc;

use super::Secret;

/// A tenant's canonical key: `auth:<id>`, `header:<id>`, `ip:<address>` or `anonymous`.
/// Cheap to clone; bounded nowhere itself (a metric's label caps its values).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(Arc<str>);

impl Tenant {
    /// `auth:<id>`: the caller proved it is `id`.
    pub fn authenticated(id: &str) -> Self {
        Self(format!("auth:{id}").into())
    }

    /// `header:<id>`: a trusted header says so.
    pub fn header(id: &str) -> Self {
        Self(format!("header:{id}").into())
    }

    /// `ip:<address>`: the connection's peer.
    pub fn ip(addr: IpAddr) -> Self {
        Self(format!("ip:{addr}").into())
    }

    /// A tenant by its canonical key, as written (a peer replica's message, say).
    pub fn from_key(key: &str) -> Self {
        Self(key.into())
    }

    pub fn anonymous() -> Self {
        Self("anonymous".into())
    }

    /// The client key's tenant, as smg names its shared key's: `auth:` and the key's SHA-256
    /// in lowercase hex (so the key itself is never a label or a log field).
    pub fn of_shared_key(key: &Secret) -> Self {
        let digest = ring::digest::digest(&ring::digest::SHA256, key.expose().as_bytes());
        let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        Self::authenticated(&hex)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The keys that name a tenant: each `--tenant-api-key`, and the `--client-api-key`.
#[derive(Debug, Clone, Default)]
pub struct TenantKeys {
    keys: Vec<(Secret, Tenant)>,
}

impl TenantKeys {
    /// `tenant_keys` as `(id, key)`, and the client key, its own tenant.
    pub fn new(tenant_keys: &[(String, Secret)], client_key: Option<&Secret>) -> Self {
        let mut keys: Vec<(Secret, Tenant)> = tenant_keys
            .iter()
            .map(|(id, key)| (key.clone(), Tenant::authenticated(id)))
            .collect();
        if let Some(key) = client_key {
            keys.push((key.clone(), Tenant::of_shared_key(key)));
        }
        Self { keys }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tenant whose key `given` is. Every key is compared, in time that depends only on
    /// the lengths, whichever matches.
    pub fn find(&self, given: &[u8]) -> Option<&Tenant> {
        let mut found = None;
        for (key, tenant) in &self.keys {
            if key.matches(given) && found.is_none() {
                found = Some(tenant);
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> Secret {
        Secret::new(s.into()).unwrap()
    }

    #[test]
    fn canonical_keys_are_smgs() {
        assert_eq!(Tenant::authenticated("team-a").as_str(), "auth:team-a");
        assert_eq!(Tenant::header("red").as_str(), "header:red");
        assert_eq!(
            Tenant::ip("203.0.113.42".parse().unwrap()).as_str(),
            "ip:203.0.113.42"
        );
        assert_eq!(Tenant::ip("::1".parse().unwrap()).as_str(), "ip:::1");
        assert_eq!(Tenant::anonymous().as_str(), "anonymous");
        // smg's shared key: auth:<sha256 hex>.
        let t = Tenant::of_shared_key(&secret("shared-secret"));
        assert_eq!(t.as_str().len(), 5 + 64);
        assert!(!t.as_str().contains("shared-secret"));
    }

    #[test]
    fn a_key_finds_its_tenant_and_no_other() {
        let keys = TenantKeys::new(
            &[
                ("team-a".into(), secret("ka")),
                ("team-b".into(), secret("kb")),
            ],
            Some(&secret("client")),
        );
        assert_eq!(keys.find(b"ka").unwrap().as_str(), "auth:team-a");
        assert_eq!(keys.find(b"kb").unwrap().as_str(), "auth:team-b");
        assert_eq!(
            keys.find(b"client"),
            Some(&Tenant::of_shared_key(&secret("client")))
        );
        assert_eq!(keys.find(b"k"), None);
        assert_eq!(keys.find(b""), None);
        assert!(TenantKeys::new(&[], None).is_empty());
    }
}
