//! Tenant identity and JWT from their flags (`--tenant-api-key`, `--trust-tenant-header`,
//! `--tenant-header-name`, `--jwt-*`), validated: a bad value names its flag, and a key is
//! never echoed.

use http::HeaderName;

use super::{Args, ConfigError};
use crate::auth::jwks::fetchable;
use crate::auth::{JwtSettings, Role, Secret, TenancySettings};

/// smg's default tenant header.
pub const DEFAULT_TENANT_HEADER: &str = "x-smg-tenant-id";

fn invalid(name: &'static str, reason: &'static str) -> ConfigError {
    ConfigError::Invalid { name, reason }
}

impl Args {
    pub(super) fn take_tenancy(&mut self) -> Result<TenancySettings, ConfigError> {
        let tenant_header = match self.trust_tenant_header {
            true => {
                let name = self.tenant_header_name.as_deref();
                Some(
                    HeaderName::from_bytes(name.unwrap_or(DEFAULT_TENANT_HEADER).as_bytes())
                        .map_err(|_| {
                            invalid("--tenant-header-name", "not a valid HTTP header name")
                        })?,
                )
            }
            false => None,
        };
        Ok(TenancySettings {
            tenant_keys: tenant_keys(&std::mem::take(&mut self.tenant_api_key))?,
            tenant_header,
            jwt: self.jwt()?,
        })
    }

    /// The rate limits, with `--tenant-rate-limit-enabled`: smg's file, read and checked.
    /// A file given without the flag is still checked, then left off (smg builds no limiter
    /// then).
    pub(super) fn take_rate_limits(
        &mut self,
    ) -> Result<Option<super::RateLimitPolicy>, ConfigError> {
        let Some(path) = self.tenant_rate_limit_config.as_deref() else {
            return match self.tenant_rate_limit_enabled {
                true => Err(invalid(
                    "--tenant-rate-limit-config",
                    "required with --tenant-rate-limit-enabled",
                )),
                false => Ok(None),
            };
        };
        let policy = super::rate_limits::load(path, self.trust_tenant_header)?;
        if !self.tenant_rate_limit_enabled {
            tracing::warn!(
                path = %path.display(),
                "--tenant-rate-limit-config without --tenant-rate-limit-enabled: no rate limits"
            );
            return Ok(None);
        }
        Ok(Some(policy))
    }

    fn jwt(&mut self) -> Result<Option<JwtSettings>, ConfigError> {
        let Some(issuer) = self.jwt_issuer.take() else {
            if self.jwt_audience.is_some()
                || self.jwt_jwks_uri.is_some()
                || !self.jwt_role_mapping.is_empty()
            {
                return Err(invalid("--jwt-issuer", "the other --jwt-* flags need it"));
            }
            return Ok(None);
        };
        if !fetchable(&issuer) {
            return Err(invalid(
                "--jwt-issuer",
                "must be an https:// URL (http:// only to localhost or a loopback address)",
            ));
        }
        let audience = (self.jwt_audience.take())
            .filter(|a| !a.is_empty())
            .ok_or(invalid("--jwt-audience", "required with --jwt-issuer"))?;
        let jwks_uri = self.jwt_jwks_uri.take();
        if jwks_uri.as_deref().is_some_and(|u| !fetchable(u)) {
            return Err(invalid(
                "--jwt-jwks-uri",
                "must be an https:// URL (http:// only to localhost or a loopback address)",
            ));
        }
        let role_mapping = std::mem::take(&mut self.jwt_role_mapping)
            .iter()
            .map(|m| role_mapping(m))
            .collect::<Result<_, _>>()?;
        Ok(Some(JwtSettings {
            issuer,
            audience,
            jwks_uri,
            role_mapping,
        }))
    }
}

/// `ID:KEY` entries: a non-empty id and key without surrounding spaces, no key twice.
fn tenant_keys(entries: &[String]) -> Result<Vec<(String, Secret)>, ConfigError> {
    let name = "--tenant-api-key";
    let mut keys: Vec<(String, Secret)> = Vec::with_capacity(entries.len());
    for entry in entries {
        let (id, key) = entry
            .split_once(':')
            .ok_or(invalid(name, "expected ID:KEY (no ':' in an entry)"))?;
        if id.is_empty() || id.trim() != id {
            return Err(invalid(name, "an ID is empty or has surrounding spaces"));
        }
        if key.trim() != key {
            return Err(invalid(name, "a KEY has surrounding spaces"));
        }
        let key = Secret::new(key.to_owned()).ok_or(invalid(name, "a KEY is empty"))?;
        if keys.iter().any(|(_, k)| k == &key) {
            return Err(invalid(name, "the same KEY is given twice"));
        }
        keys.push((id.to_owned(), key));
    }
    Ok(keys)
}

/// `IDP_ROLE=admin|user`.
fn role_mapping(entry: &str) -> Result<(String, Role), ConfigError> {
    let name = "--jwt-role-mapping";
    let (idp, role) = entry
        .split_once('=')
        .ok_or(invalid(name, "expected IDP_ROLE=admin|user (no '=')"))?;
    if idp.trim().is_empty() {
        return Err(invalid(name, "an IDP_ROLE is empty"));
    }
    let role = match role.trim() {
        "admin" => Role::Admin,
        "user" => Role::User,
        _ => return Err(invalid(name, "the role must be admin or user")),
    };
    Ok((idp.trim().to_owned(), role))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn settings(flags: &[&str]) -> Result<TenancySettings, String> {
        let mut argv = vec!["kvroute", "--worker-urls", "http://127.0.0.1:9"];
        argv.extend_from_slice(flags);
        Args::try_parse_from(argv)
            .unwrap()
            .into_settings()
            .map(|s| s.tenancy)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_flags_become_the_settings() {
        let t = settings(&[
            "--tenant-api-key",
            "team-a:ka",
            "--tenant-api-key=team-b:k:b",
            "--trust-tenant-header",
            "--jwt-issuer",
            "https://idp.example.com",
            "--jwt-audience",
            "kvroute",
            "--jwt-role-mapping",
            "Gateway.Admin=admin",
            "Gateway.User=user",
        ])
        .unwrap();
        assert_eq!(t.tenant_keys.len(), 2);
        assert_eq!(t.tenant_keys[1].0, "team-b");
        assert_eq!(t.tenant_keys[1].1.expose(), "k:b");
        assert_eq!(t.tenant_header.unwrap().as_str(), "x-smg-tenant-id");
        let jwt = t.jwt.unwrap();
        assert_eq!(jwt.jwks_uri, None);
        assert_eq!(
            jwt.role_mapping,
            [
                ("Gateway.Admin".to_owned(), Role::Admin),
                ("Gateway.User".to_owned(), Role::User)
            ]
        );
        assert_eq!(settings(&[]).unwrap(), TenancySettings::default());
    }

    #[test]
    fn bad_values_name_their_flag_and_never_the_key() {
        let cases: [(&[&str], &str); 8] = [
            (&["--tenant-api-key", "nocolon-secret"], "--tenant-api-key"),
            (&["--tenant-api-key", ":secret"], "--tenant-api-key"),
            (&["--tenant-api-key", "a:"], "--tenant-api-key"),
            (
                &["--jwt-issuer", "idp.example.com", "--jwt-audience", "x"],
                "--jwt-issuer",
            ),
            (
                &[
                    "--jwt-issuer",
                    "http://idp.example.com",
                    "--jwt-audience",
                    "x",
                ],
                "--jwt-issuer",
            ),
            (
                &["--jwt-issuer", "https://idp.example.com"],
                "--jwt-audience",
            ),
            (&["--jwt-audience", "x"], "--jwt-issuer"),
            (
                &[
                    "--jwt-issuer",
                    "https://i.example.com",
                    "--jwt-audience",
                    "x",
                    "--jwt-role-mapping",
                    "Admins",
                ],
                "--jwt-role-mapping",
            ),
        ];
        for (flags, flag) in cases {
            let err = settings(flags).unwrap_err();
            assert!(err.contains(flag), "{flags:?}: {err}");
            assert!(!err.contains("secret"), "{err}");
        }
        let err = settings(&[
            "--jwt-issuer",
            "https://i.example.com",
            "--jwt-audience",
            "x",
            "--jwt-role-mapping",
            "Admins=root",
        ])
        .unwrap_err();
        assert!(err.contains("admin or user"), "{err}");
        assert!(settings(&["--trust-tenant-header", "--tenant-header-name", "a b"]).is_err());
    }
}
