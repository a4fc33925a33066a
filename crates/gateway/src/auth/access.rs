//! Who may call, and as which tenant: the one decision for both planes.
//!
//! Data plane ([`Access::client`]), first match wins:
//! 1. a credential (`Authorization: Bearer`, else `x-api-key`) that is a tenant key or the
//!    client key: `auth:<id>` (the client key's id is its SHA-256, as smg's);
//! 2. else, with JWT on, a valid token: `auth:<subject>`; an invalid one is 401;
//! 3. else, with any key or JWT configured, 401 (no credential, or an unknown key);
//! 4. else `header:<id>` from the trusted tenant header (`--trust-tenant-header`), then, in
//!    endpoint-picker mode, from GIE's fairness id; then `ip:<peer>`; then `anonymous`.
//!
//! Admin API ([`Access::admin`]): the admin key; with JWT on, a valid token whose role maps
//! to admin (403 for any other valid token; 401 without a credential); without JWT, the
//! admin key's rules of [`super::check_admin`].

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::jwks::{HttpFetch, Jwks};
use super::jwt::{Expected, Identity};
use super::tenant::{Tenant, TenantKeys};
use super::{credential, Refusal, Secret};
use crate::http::HttpClient;

/// A role of the admin API, as smg names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    User,
}

/// `--jwt-*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtSettings {
    pub issuer: String,
    pub audience: String,
    /// `--jwt-jwks-uri`; else discovered from the issuer.
    pub jwks_uri: Option<String>,
    /// `--jwt-role-mapping IDP_ROLE=ROLE`.
    pub role_mapping: Vec<(String, Role)>,
}

/// Tenant identity and JWT (`--tenant-api-key`, `--trust-tenant-header`, `--jwt-*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenancySettings {
    /// `(id, key)`.
    pub tenant_keys: Vec<(String, Secret)>,
    /// The trusted tenant header, when trusted.
    pub tenant_header: Option<HeaderName>,
    pub jwt: Option<JwtSettings>,
}

/// What a request says of its caller.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    pub headers: &'a HeaderMap,
    /// The connection's peer, when the request came on one (not in endpoint-picker mode).
    pub peer: Option<IpAddr>,
    /// GIE's `x-gateway-inference-fairness-id` (endpoint-picker mode).
    pub fairness_id: Option<&'a str>,
}

/// The verifier of tokens, with what their claims must say.
#[derive(Debug)]
struct Jwt {
    jwks: Arc<Jwks<HttpFetch>>,
    expected: Expected,
    role_mapping: Vec<(String, Role)>,
}

impl Jwt {
    async fn verify(&self, token: &[u8]) -> Option<Identity> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let result = match std::str::from_utf8(token) {
            Ok(token) => self.jwks.verify(token, &self.expected, now).await,
            Err(_) => Err(super::jwt::TokenError::Malformed),
        };
        result
            .inspect_err(|reason| tracing::info!(%reason, "Token refused"))
            .ok()
    }

    /// The role of a token's roles: admin when one maps to admin (or, with no mapping, is
    /// `admin` itself), else user.
    fn role(&self, roles: &[String]) -> Role {
        let admin = roles.iter().any(|r| {
            if self.role_mapping.is_empty() {
                r == "admin"
            } else {
                self.role_mapping
                    .iter()
                    .any(|(idp, role)| idp == r && *role == Role::Admin)
            }
        });
        if admin {
            Role::Admin
        } else {
            Role::User
        }
    }
}

/// The keys, the trusted header and the JWT verifier; one per gateway.
#[derive(Debug)]
pub struct Access {
    keys: TenantKeys,
    header: Option<HeaderName>,
    jwt: Option<Jwt>,
}

impl Access {
    /// Does no I/O: the JWKS is fetched by [`Access::start`]'s task.
    pub fn new(tenancy: &TenancySettings, client_key: Option<&Secret>, client: HttpClient) -> Self {
        let jwt = tenancy.jwt.as_ref().map(|j| Jwt {
            jwks: Arc::new(Jwks::new(HttpFetch::new(
                client,
                &j.issuer,
                j.jwks_uri.as_deref(),
            ))),
            expected: Expected {
                issuer: j.issuer.clone(),
                audience: j.audience.clone(),
            },
            role_mapping: j.role_mapping.clone(),
        });
        Self {
            keys: TenantKeys::new(&tenancy.tenant_keys, client_key),
            header: tenancy.tenant_header.clone(),
            jwt,
        }
    }

    /// Whether an inference call must carry a credential.
    pub fn requires_credentials(&self) -> bool {
        !self.keys.is_empty() || self.jwt.is_some()
    }

    /// Starts fetching the JWKS (with JWT on), until `shutdown`.
    pub fn start(&self, tasks: &TaskTracker, shutdown: CancellationToken) {
        if let Some(jwt) = &self.jwt {
            tasks.spawn(jwt.jwks.clone().run(shutdown));
        }
    }

    /// An inference call's tenant, or why it is refused.
    pub async fn client(&self, caller: &Caller<'_>) -> Result<Tenant, Refusal> {
        match credential(caller.headers) {
            Some(given) => {
                if let Some(tenant) = self.keys.find(given) {
                    return Ok(tenant.clone());
                }
                if let Some(jwt) = &self.jwt {
                    let id = jwt.verify(given).await.ok_or(Refusal::BadToken)?;
                    return Ok(Tenant::authenticated(&id.subject));
                }
                if !self.keys.is_empty() {
                    return Err(Refusal::WrongKey);
                }
            }
            None if self.requires_credentials() => return Err(Refusal::MissingKey),
            None => {}
        }
        Ok(self.unauthenticated(caller))
    }

    /// A caller who proved nothing: the trusted header, the fairness id, the peer.
    fn unauthenticated(&self, caller: &Caller<'_>) -> Tenant {
        let trusted = self
            .header
            .as_ref()
            .and_then(|name| caller.headers.get(name))
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty());
        let fairness = caller.fairness_id.map(str::trim).filter(|v| !v.is_empty());
        match (trusted.or(fairness), caller.peer) {
            (Some(id), _) => Tenant::header(id),
            (None, Some(ip)) => Tenant::ip(ip),
            (None, None) => Tenant::anonymous(),
        }
    }

    /// An admin call: the admin key, else (JWT on) an admin token; else the key's rules.
    pub async fn admin(
        &self,
        admin_key: Option<&Secret>,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
        mutating: bool,
    ) -> Result<(), Refusal> {
        let Some(jwt) = &self.jwt else {
            return super::check_admin(admin_key, headers, peer, mutating);
        };
        let given = credential(headers).ok_or(Refusal::MissingKey)?;
        if admin_key.is_some_and(|key| key.matches(given)) {
            return Ok(());
        }
        let id = jwt.verify(given).await.ok_or(Refusal::BadToken)?;
        match jwt.role(&id.roles) {
            Role::Admin => Ok(()),
            Role::User => Err(Refusal::NotAdmin),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(tenancy: TenancySettings, client_key: Option<&str>) -> Access {
        let client_key = client_key.and_then(|k| Secret::new(k.into()));
        Access::new(&tenancy, client_key.as_ref(), crate::http::build_client())
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    async fn tenant(a: &Access, h: &HeaderMap, peer: Option<&str>) -> Result<String, Refusal> {
        let caller = Caller {
            headers: h,
            peer: peer.map(|p| p.parse().unwrap()),
            fairness_id: h
                .get("x-gateway-inference-fairness-id")
                .and_then(|v| v.to_str().ok()),
        };
        a.client(&caller).await.map(|t| t.as_str().to_owned())
    }

    #[tokio::test]
    async fn without_keys_the_header_then_the_peer_then_anonymous() {
        let open = access(TenancySettings::default(), None);
        let none = HeaderMap::new();
        assert_eq!(
            tenant(&open, &none, Some("10.0.0.7")).await.unwrap(),
            "ip:10.0.0.7"
        );
        assert_eq!(tenant(&open, &none, None).await.unwrap(), "anonymous");
        // Untrusted, the tenant header is ignored; the fairness id is taken.
        let h = headers(&[("x-smg-tenant-id", "red")]);
        assert_eq!(
            tenant(&open, &h, Some("10.0.0.7")).await.unwrap(),
            "ip:10.0.0.7"
        );
        let h = headers(&[("x-gateway-inference-fairness-id", "blue")]);
        assert_eq!(tenant(&open, &h, None).await.unwrap(), "header:blue");
        let trusting = access(
            TenancySettings {
                tenant_header: Some(HeaderName::from_static("x-smg-tenant-id")),
                ..Default::default()
            },
            None,
        );
        let h = headers(&[
            ("x-smg-tenant-id", " red "),
            ("x-gateway-inference-fairness-id", "blue"),
        ]);
        assert_eq!(
            tenant(&trusting, &h, Some("10.0.0.7")).await.unwrap(),
            "header:red"
        );
        // A client's token is its business when the router checks none.
        let h = headers(&[("authorization", "Bearer whatever")]);
        assert_eq!(tenant(&trusting, &h, None).await.unwrap(), "anonymous");
    }

    #[tokio::test]
    async fn with_keys_a_key_names_the_tenant_and_anything_else_is_refused() {
        let a = access(
            TenancySettings {
                tenant_keys: vec![("team-a".into(), Secret::new("ka".into()).unwrap())],
                tenant_header: Some(HeaderName::from_static("x-smg-tenant-id")),
                ..Default::default()
            },
            Some("client"),
        );
        let h = headers(&[("authorization", "Bearer ka"), ("x-smg-tenant-id", "red")]);
        assert_eq!(tenant(&a, &h, None).await.unwrap(), "auth:team-a");
        let h = headers(&[("x-api-key", "ka")]);
        assert_eq!(tenant(&a, &h, None).await.unwrap(), "auth:team-a");
        let h = headers(&[("authorization", "Bearer client")]);
        assert!(tenant(&a, &h, None).await.unwrap().starts_with("auth:"));
        let h = headers(&[("authorization", "Bearer kb")]);
        assert_eq!(tenant(&a, &h, None).await, Err(Refusal::WrongKey));
        let h = headers(&[("x-smg-tenant-id", "red")]);
        assert_eq!(tenant(&a, &h, None).await, Err(Refusal::MissingKey));
    }
}
