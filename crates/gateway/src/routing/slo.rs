//! A request's latency targets from its headers: llm-d's `x-llm-d-slo-ttft-ms` and
//! `x-llm-d-slo-tpot-ms`, SGLang's `x-sgl-ttft-slo-ms`, and kvroute's `x-kvroute-slo-ttft-ms`
//! and `x-kvroute-slo-tpot-ms`. Each is a positive number of milliseconds; where several
//! name one target (or one header comes twice), the tightest counts. A value that is not a
//! positive, finite number is a 400 naming the header.

use http::HeaderMap;
use kvroute_core::slo::SloTargets;

use crate::error::GatewayError;

/// The headers naming a TTFT target.
pub const TTFT_HEADERS: [&str; 3] = [
    "x-llm-d-slo-ttft-ms",
    "x-sgl-ttft-slo-ms",
    "x-kvroute-slo-ttft-ms",
];

/// The headers naming a TPOT target.
pub const TPOT_HEADERS: [&str; 2] = ["x-llm-d-slo-tpot-ms", "x-kvroute-slo-tpot-ms"];

/// The tightest of the targets `names` give, if any.
fn tightest(headers: &HeaderMap, names: &[&'static str]) -> Result<Option<f64>, GatewayError> {
    let mut target: Option<f64> = None;
    for &name in names {
        for value in headers.get_all(name) {
            let invalid = |reason: String| GatewayError::InvalidHint {
                header: name,
                reason,
            };
            let text = value
                .to_str()
                .map_err(|_| invalid("not visible ASCII".into()))?
                .trim();
            let ms = text
                .parse::<f64>()
                .ok()
                .filter(|ms| ms.is_finite() && *ms > 0.0)
                .ok_or_else(|| {
                    invalid(format!("'{text}' is not a positive number of milliseconds"))
                })?;
            target = Some(target.map_or(ms, |t| t.min(ms)));
        }
    }
    Ok(target)
}

/// The request's targets (none when it names none).
pub fn slo_targets(headers: &HeaderMap) -> Result<SloTargets, GatewayError> {
    Ok(SloTargets {
        ttft_ms: tightest(headers, &TTFT_HEADERS)?,
        tpot_ms: tightest(headers, &TPOT_HEADERS)?,
    })
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(*name, HeaderValue::from_bytes(value).unwrap());
        }
        h
    }

    #[test]
    fn none_without_headers() {
        assert_eq!(
            slo_targets(&HeaderMap::new()).unwrap(),
            SloTargets::default()
        );
    }

    #[test]
    fn every_spelling_is_read_and_the_tightest_wins() {
        let h = headers(&[
            ("x-llm-d-slo-ttft-ms", b"800"),
            ("x-sgl-ttft-slo-ms", b" 250.5 "),
            ("x-kvroute-slo-ttft-ms", b"1000"),
            ("x-llm-d-slo-tpot-ms", b"40"),
        ]);
        let t = slo_targets(&h).unwrap();
        assert_eq!((t.ttft_ms, t.tpot_ms), (Some(250.5), Some(40.0)));
        for name in TTFT_HEADERS {
            let t = slo_targets(&headers(&[(name, b"300")])).unwrap();
            assert_eq!((t.ttft_ms, t.tpot_ms), (Some(300.0), None), "{name}");
        }
        // One header twice: the tightest.
        let h = headers(&[
            ("x-kvroute-slo-tpot-ms", b"50"),
            ("x-kvroute-slo-tpot-ms", b"20"),
        ]);
        assert_eq!(slo_targets(&h).unwrap().tpot_ms, Some(20.0));
    }

    #[test]
    fn a_malformed_or_non_positive_value_is_a_400_naming_the_header() {
        for bad in [
            &b"0"[..],
            b"-5",
            b"abc",
            b"",
            b"NaN",
            b"inf",
            b"1e400",
            b"\xff",
        ] {
            let e = slo_targets(&headers(&[("x-sgl-ttft-slo-ms", bad)])).unwrap_err();
            assert_eq!(e.status(), http::StatusCode::BAD_REQUEST, "{bad:?}");
            assert_eq!(e.code(), "invalid_hint");
            let msg = e.to_string();
            assert!(msg.contains("x-sgl-ttft-slo-ms"), "{msg}");
        }
        let e = slo_targets(&headers(&[("x-llm-d-slo-tpot-ms", b"fast")])).unwrap_err();
        assert!(
            e.to_string()
                .contains("'fast' is not a positive number of milliseconds"),
            "{e}"
        );
    }
}
