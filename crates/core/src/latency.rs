//! Per-(worker, rank) latency models learned online from what the router observes, for
//! `kv_aware`'s predicted cost ([`crate::policy::predict`]).
//!
//! Two linear models per (worker, dp rank), each over features the router knows when it
//! routes, and the time of one LoRA adapter load (below):
//!
//! ```text
//! TTFT_ms       = a0 + a1 * W / 1000 + a2 * D / 100 + a3 * h(u')     (the prefill model)
//! step_ms (ITL) = b * g(R, u)                                          (the decode model)
//! h(u')         = max(0, u' - 0.8) / 0.2
//! g(R, u)       = max(1, -25.74 u^2 + 54.01 u + 5.74) + 0.1 R       (the reference step)
//! ```
//!
//! `W` is the prompt tokens the rank must compute before this request's first token: those
//! routed there still prefilling plus this request's uncached ones; `D` the requests decoding
//! there; `u'` the KV utilisation the rank would reach with this request's new blocks (the
//! hinge `h` is 0 until 80% and 1 when full: a rank short of KV queues and preempts); `R`
//! the sequences running at a decode step and `u` the KV utilisation then. The prefill model
//! is fed each request's features at routing and its observed TTFT; the decode model each
//! observed inter-token gap of a stream. `a1` (ms per thousand prompt tokens) and `b` (the
//! step over the reference engine's at the same batch and KV use) are the rank's fitted
//! speeds. The decode model has one coefficient because its natural features (running
//! sequences and KV use) rise together: fitted separately, their split is unidentifiable
//! from a busy engine's steps and wandered to the bounds in a 3-coefficient fit (measured on
//! a synthetic batch that drifts as a real one does); a speed factor over the timing
//! model's curve is always identified.
//!
//! **The estimator** is recursive least squares with exponential forgetting (`lambda`
//! 0.995: an observation's weight halves after ~140 newer ones), chosen because it is exact
//! for a linear model, costs O(n^2) per observation for n = 1 or 4 features, needs no
//! learning rate, and its forgetting follows a worker whose speed changes at run time. Three
//! guards keep it bounded:
//! - **a prior**: the coefficients start at the timing model's (a Llama-class 8B on one
//!   H100-class GPU, `kvroute-sim`'s defaults) with covariance `P0 = I`, so a new
//!   worker predicts sensibly and a few dozen observations move it;
//! - **clipped residuals** (Huber-like): a residual beyond 3 robust scales `s` (an
//!   exponential average of recent absolute residuals, each counted at most 10 s) is
//!   clipped, so one stalled stream or a garbage timing does not move the fit far, while a
//!   real shift in speed (every residual large) raises `s` within ~10 observations and is
//!   followed;
//! - **bounds**: coefficients are clamped to a physical box (no negative time per token,
//!   nothing above minutes), each coefficient's variance is capped (at its prior's) so that
//!   a feature no observation excites (the KV hinge on a roomy engine) cannot wind the
//!   covariance up, and the covariance is kept symmetric and restarted if rounding ever
//!   costs it its positive definiteness.
//!
//! **The adapter load time** (per (worker, rank), like the rest): a request routed where its
//! LoRA adapter is expected to need `L` > 0 loads ([`PrefillFeatures::adapter_loads`], from
//! [`crate::AdapterFit::expected_loads`]) waits for them before its first token, so the
//! residual of its observed TTFT against the prefill model's TTFT without the loads is `L`
//! samples of one load's time:
//!
//! ```text
//! TTFT_ms - TTFT model(W, D, u')  =  c * L                            (the load model)
//! ```
//!
//! `c` (ms a load) is fitted by the same estimator with one feature, `L`: with a constant
//! feature, RLS with forgetting is an exponentially weighted mean of the samples (over
//! ~200), and the clipped residuals make it a Huber-like M-estimate of their location. A
//! mean, not a median, because the samples are a mixture: a load predicted but not needed
//! (another request loaded the adapter first) gives ~0, one that also waited for a slot
//! more than `c`; the prediction charges `c * L` for the expected cost of such loads, which
//! is the mixture's mean, and a median would jump to whichever case is the majority. The
//! clipping bounds an outlier's pull (a stalled stream moves `c` by at most `3 s` times the
//! gain, `s` the robust scale). The prior is [`ADAPTER_LOAD_PRIOR_MS`] (50, kvroute-sim's
//! default and vLLM's tens of milliseconds from host memory); `c` is clamped to
//! `[0, ADAPTER_LOAD_MAX_MS]` (no negative load; a minute is more than a load from remote
//! storage takes). Such a request teaches the prefill model its TTFT less the fitted loads,
//! `TTFT_ms - c * L`, so the TTFT intercept does not absorb the loads (they would be counted
//! twice). The split is identified by the requests without loads: were every request to need
//! one, an intercept and `c` would trade off, and `c` would stay near its prior.
//!
//! **Speed factors.** Beside the fits, each rank keeps two scalars that say how much slower
//! than the reference engine it is, for the `calibrated` cost model
//! ([`crate::policy::KvAware`]):
//!
//! ```text
//! prefill factor = exp(median of ln((TTFT - c * L) / prior TTFT(features)))
//! decode factor  = exp(20th percentile of ln(gap / reference step(R, u)))
//! ```
//!
//! each tracked online by a stochastic quantile in log space: a step of [`FACTOR_STEP`]
//! towards each observation, up with weight `tau` and down with `1 - tau`,
//! kept within e^±3. A quantile moves by the same step whatever the observation's size, so
//! an outlier (a stalled stream, a TTFT spent in a queue) moves it no more than any other.
//! At its [`FACTOR_WARMUP`]th observation, when the factor starts to count, the exact
//! quantile of the observations so far replaces the stepped one if they differ by more than
//! the noise band ([`SPEED_NOISE`](crate::policy::SPEED_NOISE)): steps from the prior would
//! take hundreds of observations to reach a rank far from it, and on the way the ranks that
//! served more would read further from the prior than the idle ones (measured: 256 engines
//! twenty times faster than the prior, where the busier ranks read faster and took every
//! new prefix). Before that, from [`FACTOR_EARLY`] observations on, the factor reads the
//! quantile of the observations so far: a first reading, which the calibrated cost uses to
//! stop trying an idle rank found slow, and counts from
//! [`SPEED_EVIDENCE`](crate::policy::SPEED_EVIDENCE) observations on.
//! The decode factor is a low quantile because an inter-token gap includes any prefill
//! chunk that shares its step: the median of the gaps measures how much prefill a rank
//! mixes in, its lower fifth the steps closest to pure decode. Why not the fits' own
//! coefficients: on eight identical engines in Dynamo's engine model at 5x the Mooncake
//! trace's rate, the fitted `a1` ranged 0.1-39 ms per thousand tokens and `b` 1.1-3.8, one
//! engine against another (queueing the features do not explain, steps shared with prefill
//! chunks); these two factors stayed within 0.7-1.5 there and found 0.5, 1 and 2 on
//! engines of those speeds.

/// Recursive least squares with forgetting, clipped residuals and clamped coefficients
/// (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OnlineFit<const N: usize> {
    theta: [f64; N],
    p: [[f64; N]; N],
    lower: [f64; N],
    upper: [f64; N],
    /// The robust scale of residuals.
    scale: f64,
    observations: u64,
}

/// Forgetting factor.
const LAMBDA: f64 = 0.995;
/// Prior covariance, per coefficient.
const P0: f64 = 1.0;
/// Cap on each coefficient's variance.
const P_MAX: f64 = 1.0;
/// Residuals are clipped at this many robust scales.
const CLIP: f64 = 3.0;
/// Weight of a new absolute residual in the robust scale.
const SCALE_ALPHA: f64 = 0.05;
/// A speed factor's step in log space per observation (see "Speed factors").
pub const FACTOR_STEP: f64 = 0.02;
/// The prefill model's prior coefficients (see [`LatencyModel::default`]).
const PREFILL_PRIOR: [f64; 4] = [25.0, 20.0, 10.0, 200.0];

/// After this many observations a speed factor starts from their own quantile when that is
/// outside the noise band of the stepped one (see "Speed factors").
pub const FACTOR_WARMUP: usize = 20;

/// From this many observations on, before [`FACTOR_WARMUP`], a speed factor reads the
/// quantile of the observations so far (a first reading, which the calibrated model uses to
/// stop trying a rank found slow: [`Cluster::prices_of`](crate::policy::Cluster::prices_of)).
pub const FACTOR_EARLY: usize = 4;

/// An online quantile of `ln(x)`, as a factor (see "Speed factors").
#[derive(Debug, Clone, Copy, PartialEq)]
struct LogQuantile {
    log: f64,
    tau: f64,
    /// The logs of the first [`FACTOR_WARMUP`] observations (`seen` of them so far).
    first: [f32; FACTOR_WARMUP],
    seen: u8,
    /// The quantile of those, kept as they come from [`FACTOR_EARLY`] on (the factor read
    /// until [`FACTOR_WARMUP`]; computed here, not on every read: a decision reads each
    /// candidate's factors).
    reading: f64,
}

impl LogQuantile {
    fn new(tau: f64) -> Self {
        Self {
            log: 0.0,
            tau,
            first: [0.0; FACTOR_WARMUP],
            seen: 0,
            reading: 0.0,
        }
    }

    /// One ratio of observed to reference; a non-finite or non-positive one is ignored.
    fn observe(&mut self, ratio: f64) {
        if !(ratio.is_finite() && ratio > 0.0) {
            return;
        }
        let below = if ratio.ln() < self.log { 1.0 } else { 0.0 };
        self.log = (self.log + FACTOR_STEP * (self.tau - below)).clamp(-3.0, 3.0);
        let seen = usize::from(self.seen);
        if seen < FACTOR_WARMUP {
            self.first[seen] = ratio.ln().clamp(-3.0, 3.0) as f32;
            self.seen += 1;
            if seen + 1 >= FACTOR_EARLY {
                self.reading = self.first_quantile();
            }
            if seen + 1 == FACTOR_WARMUP {
                // The factor starts to count now. Steps from the prior have moved it at most
                // a few tenths; were the rank far from the prior, the factor would be on its
                // way still, and further along the more the rank served, so that the busier
                // ranks of a cluster of engines faster (or slower) than the prior would read
                // faster (slower) than the idle ones, whatever their speed. When the first
                // observations' own quantile (nearest rank) is outside the noise band of the
                // stepped factor, it starts from that quantile instead.
                if (self.reading - self.log).abs() > crate::policy::SPEED_NOISE {
                    self.log = self.reading;
                }
            }
        }
    }

    /// The quantile (nearest rank) of the logs of the observations seen so far, up to
    /// [`FACTOR_WARMUP`].
    fn first_quantile(&self) -> f64 {
        let mut logs = self.first;
        let logs = &mut logs[..usize::from(self.seen)];
        logs.sort_unstable_by(f32::total_cmp);
        let rank = (self.tau * logs.len() as f64).ceil().max(1.0) as usize - 1;
        f64::from(logs[rank])
    }

    /// The stepped quantile, or, from [`FACTOR_EARLY`] observations until
    /// [`FACTOR_WARMUP`], the quantile of those seen (the stepped one has barely left the
    /// prior then).
    fn factor(&self) -> f64 {
        if (FACTOR_EARLY..FACTOR_WARMUP).contains(&usize::from(self.seen)) {
            self.reading.exp()
        } else {
            self.log.exp()
        }
    }
}

impl<const N: usize> OnlineFit<N> {
    /// A fit starting at `prior`, kept within `[lower, upper]`; `scale` is the residual
    /// size expected at first (ms).
    pub fn new(prior: [f64; N], lower: [f64; N], upper: [f64; N], scale: f64) -> Self {
        let p = Self::fresh_covariance();
        let mut theta = prior;
        for i in 0..N {
            theta[i] = theta[i].clamp(lower[i], upper[i]);
        }
        Self {
            theta,
            p,
            lower,
            upper,
            scale: scale.max(1e-3),
            observations: 0,
        }
    }

    fn fresh_covariance() -> [[f64; N]; N] {
        let mut p = [[0.0; N]; N];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = P0;
        }
        p
    }

    pub fn coefficients(&self) -> [f64; N] {
        self.theta
    }

    pub fn observations(&self) -> u64 {
        self.observations
    }

    pub fn predict(&self, x: &[f64; N]) -> f64 {
        dot(&self.theta, x)
    }

    /// One observation `y` at features `x`; a non-finite one is ignored.
    pub fn observe(&mut self, x: &[f64; N], y: f64) {
        if !y.is_finite() || x.iter().any(|v| !v.is_finite()) {
            return;
        }
        let e = y - self.predict(x);
        let clipped = e.clamp(-CLIP * self.scale, CLIP * self.scale);
        self.scale = ((1.0 - SCALE_ALPHA) * self.scale
            + SCALE_ALPHA * e.abs().min(10.0 * self.scale))
        .max(1e-3);
        // k = P x / (lambda + x' P x)
        let mut px: [f64; N] = std::array::from_fn(|i| dot(&self.p[i], x));
        let xpx = dot(x, &px);
        if !(xpx.is_finite() && xpx >= 0.0) {
            // Rounding cost the covariance its positive definiteness: start it afresh.
            self.p = Self::fresh_covariance();
            px = std::array::from_fn(|i| dot(&self.p[i], x));
        }
        let denom = LAMBDA + dot(x, &px);
        let k: [f64; N] = std::array::from_fn(|i| px[i] / denom);
        for (i, t) in self.theta.iter_mut().enumerate() {
            *t = (*t + k[i] * clipped).clamp(self.lower[i], self.upper[i]);
        }
        // P = (P - k x' P) / lambda; P is symmetric, so x' P = px'.
        for (row, ki) in self.p.iter_mut().zip(k) {
            for (v, pj) in row.iter_mut().zip(px) {
                *v = (*v - ki * pj) / LAMBDA;
            }
        }
        // Keep it exactly symmetric (rounding drifts it).
        for i in 0..N {
            for j in 0..i {
                let m = 0.5 * (self.p[i][j] + self.p[j][i]);
                self.p[i][j] = m;
                self.p[j][i] = m;
            }
        }
        // A coefficient no observation excites (a feature that stays 0) would see its
        // variance grow without end: cap each diagonal, scaling its row and column alike
        // (D P D with D diagonal keeps P symmetric and positive).
        for i in 0..N {
            if self.p[i][i] > P_MAX {
                let f = (P_MAX / self.p[i][i]).sqrt();
                for j in 0..N {
                    self.p[i][j] *= f;
                    self.p[j][i] *= f;
                }
            }
        }
        self.observations += 1;
    }
}

fn dot<const N: usize>(a: &[f64; N], b: &[f64; N]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// What the router knows of a request on a rank when it routes it (the prefill model's
/// features, and the adapter loads it is expected to wait for: see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefillFeatures {
    /// Prompt tokens to compute there before this request's first token, its own included.
    pub tokens: f64,
    /// Requests decoding there.
    pub decoding: f64,
    /// KV utilisation the rank would reach with the request, in [0, 1] (0 when unknown).
    pub kv_after: f64,
    /// LoRA adapter loads expected before its first token
    /// ([`crate::AdapterFit::expected_loads`]; 0 without an adapter).
    pub adapter_loads: f64,
}

impl PrefillFeatures {
    fn x(&self) -> [f64; 4] {
        [
            1.0,
            self.tokens.max(0.0) / 1000.0,
            self.decoding.max(0.0) / 100.0,
            ((self.kv_after - 0.8) / 0.2).clamp(0.0, 1.0),
        ]
    }
}

/// What the router knows of a decode step (the decode model's features).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DecodeFeatures {
    /// Sequences running.
    pub running: f64,
    /// KV utilisation, in [0, 1].
    pub kv_usage: f64,
}

impl DecodeFeatures {
    /// The reference engine's step at these features (ms): the timing model's decode curve.
    pub fn reference_step_ms(&self) -> f64 {
        let u = self.kv_usage.clamp(0.0, 1.0);
        (-25.74 * u * u + 54.01 * u + 5.74).max(1.0) + 0.1 * self.running.max(0.0)
    }

    fn x(&self) -> [f64; 1] {
        [self.reference_step_ms()]
    }
}

/// A rank's fitted coefficients, as policies read them (see the module docs for their
/// meaning).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FittedSpeed {
    /// `a0..a3`: TTFT intercept, ms per thousand tokens to compute, per hundred decoding, at
    /// a full KV cache.
    pub prefill: [f64; 4],
    /// `b`: the rank's decode step over the reference engine's at the same batch and KV
    /// use (2: twice as slow).
    pub decode: f64,
    /// The mean output length of the requests answered there (an exponential average over
    /// ~100 requests; the prior: 200).
    pub output_tokens: f64,
    /// The time of one LoRA adapter load (ms; the load model's `c`).
    pub adapter_load_ms: f64,
    /// Observations behind each (0: the prior).
    pub prefill_observations: u64,
    pub decode_observations: u64,
    pub adapter_load_observations: u64,
    /// The rank's TTFT over the prior model's at the same features, and its decode step
    /// over the reference step: robust quantiles (see "Speed factors"; 1 at first).
    pub prefill_factor: f64,
    pub decode_factor: f64,
}

/// What the weighted and calibrated costs read of a rank's speed: its two factors and the
/// observations behind them ([`FittedSpeed`]'s fields of those names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedFactors {
    pub prefill_factor: f64,
    pub decode_factor: f64,
    pub prefill_observations: u64,
    pub decode_observations: u64,
}

impl FittedSpeed {
    pub fn factors(&self) -> SpeedFactors {
        SpeedFactors {
            prefill_factor: self.prefill_factor,
            decode_factor: self.decode_factor,
            prefill_observations: self.prefill_observations,
            decode_observations: self.decode_observations,
        }
    }
}

impl Default for FittedSpeed {
    /// The prior.
    fn default() -> Self {
        *Self::prior()
    }
}

impl FittedSpeed {
    /// The prior, computed once.
    pub fn prior() -> &'static FittedSpeed {
        static PRIOR: std::sync::OnceLock<FittedSpeed> = std::sync::OnceLock::new();
        PRIOR.get_or_init(|| LatencyModel::default().speed())
    }
}

impl FittedSpeed {
    /// Predicted TTFT (ms).
    pub fn ttft_ms(&self, f: &PrefillFeatures) -> f64 {
        dot(&self.prefill, &f.x()).max(0.0)
    }

    /// Predicted prefill time of `tokens` alone, at the marginal rate (ms).
    pub fn prefill_ms(&self, tokens: f64) -> f64 {
        self.prefill[1] * tokens.max(0.0) / 1000.0
    }

    /// Predicted decode step, the inter-token gap (ms).
    pub fn step_ms(&self, f: &DecodeFeatures) -> f64 {
        self.decode * f.reference_step_ms()
    }
}

/// The adapter load model's prior: one load, in milliseconds (see the module docs).
pub const ADAPTER_LOAD_PRIOR_MS: f64 = 50.0;
/// The most one adapter load is taken to cost, in milliseconds.
pub const ADAPTER_LOAD_MAX_MS: f64 = 60_000.0;

/// One (worker, rank)'s models (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    prefill: OnlineFit<4>,
    decode: OnlineFit<1>,
    adapter_load: OnlineFit<1>,
    output_tokens: f64,
    prefill_factor: LogQuantile,
    decode_factor: LogQuantile,
}

impl Default for LatencyModel {
    /// The prior: the timing model's engine (`kvroute-sim`'s defaults, speed 1). Its TTFT
    /// is ~16.5 ms per step plus ~15 ms per thousand tokens, and ~22 ms per thousand once
    /// chunks of 8,192 are full (the quadratic term); its step is the reference curve
    /// (`b` = 1).
    fn default() -> Self {
        Self {
            prefill: OnlineFit::new(
                PREFILL_PRIOR,
                [0.0, 0.05, 0.0, 0.0],
                [60_000.0, 10_000.0, 60_000.0, 600_000.0],
                20.0,
            ),
            decode: OnlineFit::new([1.0], [0.01], [100.0], 2.0),
            adapter_load: OnlineFit::new(
                [ADAPTER_LOAD_PRIOR_MS],
                [0.0],
                [ADAPTER_LOAD_MAX_MS],
                20.0,
            ),
            output_tokens: 200.0,
            prefill_factor: LogQuantile::new(0.5),
            decode_factor: LogQuantile::new(0.2),
        }
    }
}

impl LatencyModel {
    /// A request routed with features `f` produced its first token after `ttft_ms`: with
    /// adapter loads expected, the residual over the prefill model teaches the load model,
    /// and the TTFT less the fitted loads the prefill model (see the module docs).
    pub fn observe_ttft(&mut self, f: &PrefillFeatures, ttft_ms: f64) {
        let loads = f.adapter_loads;
        let ttft_ms = if loads.is_finite() && loads > 0.0 {
            let without_loads = self.prefill.predict(&f.x()).max(0.0);
            self.adapter_load.observe(&[loads], ttft_ms - without_loads);
            ttft_ms - loads * self.adapter_load.coefficients()[0]
        } else {
            ttft_ms
        };
        self.prefill.observe(&f.x(), ttft_ms);
        // The speed factor reads the TTFT less the fitted loads too: a rank loading adapters
        // is not a slower rank.
        let prior = dot(&PREFILL_PRIOR, &f.x()).max(1.0);
        self.prefill_factor.observe(ttft_ms / prior);
    }

    /// A stream's tokens came `gap_ms` apart at a step with features `f`.
    pub fn observe_gap(&mut self, f: &DecodeFeatures, gap_ms: f64) {
        self.decode.observe(&f.x(), gap_ms);
        self.decode_factor
            .observe(gap_ms / f.reference_step_ms().max(0.1));
    }

    /// A request answered there produced `tokens` output tokens.
    pub fn observe_output(&mut self, tokens: f64) {
        if tokens.is_finite() && tokens >= 0.0 {
            self.output_tokens += 0.01 * (tokens.min(1e6) - self.output_tokens);
        }
    }

    pub fn speed(&self) -> FittedSpeed {
        FittedSpeed {
            output_tokens: self.output_tokens,
            prefill: self.prefill.coefficients(),
            decode: self.decode.coefficients()[0],
            adapter_load_ms: self.adapter_load.coefficients()[0],
            prefill_observations: self.prefill.observations(),
            decode_observations: self.decode.observations(),
            adapter_load_observations: self.adapter_load.observations(),
            prefill_factor: self.prefill_factor.factor(),
            decode_factor: self.decode_factor.factor(),
        }
    }
}

#[cfg(test)]
mod tests;
