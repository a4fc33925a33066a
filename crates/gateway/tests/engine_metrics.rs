//! The engine metrics scraper over real HTTP: a kvroute-sim engine with two data-parallel
//! ranks, servers answering what is not Prometheus text, hanging and dead servers.
//!
//! Staleness is checked by passing `now` to `EngineGauges::load`, never by sleeping; the
//! waits below only poll for what a real-time engine or scraper has done, with a deadline.

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_gateway::engine_metrics::{
    EngineGauges, EngineMetricsScraper, ScrapeError, ScrapePace, ScrapeStats, ScrapeTiming,
    STALE_AFTER,
};
use kvroute_gateway::http::build_client;
use kvroute_sim::{SimArgs, SimServer};
use kvroute_tokenizer::Tokenizer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use support::wait_until;

const FAST: ScrapeTiming = ScrapeTiming {
    interval: Duration::from_millis(10),
    timeout: Duration::from_millis(500),
};

struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<()>,
    stats: Arc<ScrapeStats>,
}

impl Running {
    fn start(scraper: EngineMetricsScraper) -> Running {
        let shutdown = CancellationToken::new();
        let stats = scraper.stats();
        let task = tokio::spawn(scraper.run(build_client(), shutdown.clone()));
        Running {
            shutdown,
            task,
            stats,
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the scraper stops on shutdown")
            .unwrap();
    }
}

/// An HTTP server on 127.0.0.1:0 serving `app`, stopped when dropped.
struct Server {
    url: String,
    task: JoinHandle<()>,
}

impl Server {
    async fn start(app: axum::Router) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Server { url, task }
    }

    /// A server whose `/metrics` answers `body()`.
    async fn metrics<F, Fut>(body: F) -> Server
    where
        F: Fn() -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = (http::StatusCode, String)> + Send + 'static,
    {
        Server::start(axum::Router::new().route("/metrics", get(body))).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn dead_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

/// The gauges of each data-parallel rank of one worker.
type RankGauges = Vec<(Option<u32>, Arc<EngineGauges>)>;

fn one_rank() -> (Arc<EngineGauges>, RankGauges) {
    let g = Arc::new(EngineGauges::new());
    (g.clone(), vec![(None, g)])
}

const GOOD: &str = "# TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 5.0\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n";

#[tokio::test]
async fn a_simulated_engine_s_ranks_report_their_load_and_blocks() {
    let args = <SimArgs as clap::Parser>::parse_from([
        "kvroute-sim",
        "--data-parallel-size",
        "2",
        "--max-num-seqs",
        "1",
    ]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sim_url = format!("http://{}", listener.local_addr().unwrap());
    let sim_shutdown = CancellationToken::new();
    let sim = tokio::spawn(
        SimServer::new(args, Arc::new(Tokenizer::fallback())).serve(listener, sim_shutdown.clone()),
    );

    let ranks: Vec<_> = (0..2)
        .map(|r| (Some(r), Arc::new(EngineGauges::new())))
        .collect();
    let g = [ranks[0].1.clone(), ranks[1].1.clone()];
    let scraper = EngineMetricsScraper::new("sim", &format!("{sim_url}/"), ranks, FAST).unwrap();
    let run = Running::start(scraper);

    wait_until("both ranks read", || {
        g.iter()
            .all(|g| g.load(Instant::now()).running == Some(0.0))
    })
    .await;
    for g in &g {
        let load = g.load(Instant::now());
        assert_eq!(load.waiting, Some(0.0));
        assert_eq!(load.kv_usage, Some(0.0));
        assert_eq!(load.num_gpu_blocks, Some(16384));
        assert_eq!(g.engine_block_size(), Some(16));
    }

    // Two endless streams on rank 1, which runs one sequence at a time: one runs, one waits.
    // Each is held open by its own task; aborting the task drops the stream.
    let client = build_client();
    let streams: Vec<JoinHandle<()>> = (0..2)
        .map(|_| {
            let body =
                r#"{"prompt": "a prompt of some length", "max_tokens": 100000, "stream": true}"#;
            let req = http::Request::post(format!("{sim_url}/v1/completions"))
                .header("content-type", "application/json")
                .header("x-data-parallel-rank", "1")
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            let client = client.clone();
            tokio::spawn(async move {
                let mut body = client.request(req).await.unwrap().into_body();
                while let Some(Ok(_)) = body.frame().await {}
            })
        })
        .collect();
    wait_until("rank 1 busy", || {
        let l = g[1].load(Instant::now());
        l.running == Some(1.0) && l.waiting == Some(1.0) && l.kv_usage.is_some_and(|u| u > 0.0)
    })
    .await;
    let idle = g[0].load(Instant::now());
    assert_eq!((idle.running, idle.waiting), (Some(0.0), Some(0.0)));

    for stream in streams {
        stream.abort();
        let _ = stream.await;
    }
    wait_until("rank 1 idle again", || {
        g[1].load(Instant::now()).running == Some(0.0)
    })
    .await;
    assert_eq!(run.stats.failed(), 0);

    // The engine goes away: scrapes fail, the last reading ages out, the block count stays.
    sim_shutdown.cancel();
    sim.await.unwrap().unwrap();
    let failed = run.stats.failed();
    wait_until("scrapes fail", || run.stats.failed() > failed + 2).await;
    let last = g[1].last_reading().expect("read before");
    let later = last + STALE_AFTER + Duration::from_millis(1);
    let stale = g[1].load(later);
    assert_eq!(
        (stale.waiting, stale.running, stale.kv_usage),
        (None, None, None)
    );
    assert_eq!(stale.num_gpu_blocks, Some(16384));
    run.stop().await;
}

#[tokio::test]
async fn a_body_that_is_not_prometheus_text_leaves_the_reading_to_go_stale() {
    let answer = Arc::new(Mutex::new(GOOD.to_owned()));
    let served = answer.clone();
    let server = Server::metrics(move || {
        let body = served.lock().unwrap().clone();
        async move { (http::StatusCode::OK, body) }
    })
    .await;
    let (g, ranks) = one_rank();
    let scraper = EngineMetricsScraper::new("w", &server.url, ranks, FAST).unwrap();
    let run = Running::start(scraper);
    wait_until("a good reading", || g.last_reading().is_some()).await;
    let fresh = g.load(Instant::now());
    assert_eq!(
        (fresh.waiting, fresh.running, fresh.kv_usage),
        (Some(2.0), Some(5.0), Some(0.5))
    );

    for bad in [
        "<!DOCTYPE html><html><body><h1>It works</h1></body></html>",
        r#"{"object": "list", "data": []}"#,
        "vllm:num_requests_waiting{engine=\"0\"} 3\nvllm:num_requests_running{engi",
    ] {
        *answer.lock().unwrap() = bad.to_owned();
        let failed = run.stats.failed();
        wait_until("bad bodies rejected", || run.stats.failed() >= failed + 2).await;
        let last = g.last_reading().unwrap();
        // Nothing stored since: the reading is the good one, and it ages out.
        wait_until("another rejection", || run.stats.failed() >= failed + 3).await;
        assert_eq!(g.last_reading(), Some(last), "{bad}");
        assert_eq!(g.load(last).waiting, Some(2.0));
        assert_eq!(g.load(last + STALE_AFTER).waiting, Some(2.0));
        let stale = g.load(last + STALE_AFTER + Duration::from_millis(1));
        assert_eq!(
            (stale.waiting, stale.running, stale.kv_usage),
            (None, None, None)
        );
    }
    run.stop().await;
}

#[tokio::test]
async fn each_failure_is_an_error_not_a_reading() {
    let client = &build_client();
    let scrape = |url: String| async move {
        let (g, ranks) = one_rank();
        let s = EngineMetricsScraper::new("w", &url, ranks, FAST).unwrap();
        let r = s.scrape_once(client).await;
        assert!(g.last_reading().is_none());
        r
    };

    let html =
        Server::metrics(|| async { (http::StatusCode::OK, "<html></html>".to_owned()) }).await;
    assert!(matches!(
        scrape(html.url.clone()).await,
        Err(ScrapeError::NotPrometheus(_))
    ));
    let missing =
        Server::metrics(|| async { (http::StatusCode::NOT_FOUND, GOOD.to_owned()) }).await;
    assert!(matches!(
        scrape(missing.url.clone()).await,
        Err(ScrapeError::Status(http::StatusCode::NOT_FOUND))
    ));
    assert!(matches!(
        scrape(dead_url().await).await,
        Err(ScrapeError::Request(_))
    ));
    let good = Server::metrics(|| async { (http::StatusCode::OK, GOOD.to_owned()) }).await;
    let readings = scrape(good.url.clone()).await.unwrap();
    assert_eq!(readings.rank(0).unwrap().waiting, Some(2.0));
    assert!(matches!(
        EngineMetricsScraper::new("w", "not a url", vec![], FAST),
        Err(ScrapeError::InvalidUrl { .. })
    ));
}

#[tokio::test]
async fn a_dead_engine_is_never_read_and_the_scraper_keeps_trying() {
    let (g, ranks) = one_rank();
    g.set_num_gpu_blocks(Some(1024));
    let scraper = EngineMetricsScraper::new("w", &dead_url().await, ranks, FAST).unwrap();
    let run = Running::start(scraper);
    wait_until("failures counted", || run.stats.failed() >= 3).await;
    assert_eq!(run.stats.ok(), 0);
    let load = g.load(Instant::now());
    assert_eq!(
        (load.waiting, load.running, load.kv_usage),
        (None, None, None)
    );
    assert_eq!(
        load.num_gpu_blocks,
        Some(1024),
        "the configured count is known"
    );
    run.stop().await;
}

#[tokio::test]
async fn scrapes_never_overlap_nor_come_faster_than_the_interval() {
    // Each answer takes 30 ms, longer than the 10 ms interval.
    let arrivals = Arc::new(Mutex::new(Vec::<(Instant, usize)>::new()));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (a, f) = (arrivals.clone(), in_flight.clone());
    let server = Server::metrics(move || {
        let (a, f) = (a.clone(), f.clone());
        async move {
            let concurrent = f.fetch_add(1, Ordering::SeqCst) + 1;
            a.lock().unwrap().push((Instant::now(), concurrent));
            tokio::time::sleep(Duration::from_millis(30)).await;
            f.fetch_sub(1, Ordering::SeqCst);
            (http::StatusCode::OK, GOOD.to_owned())
        }
    })
    .await;
    let (_, ranks) = one_rank();
    let run = Running::start(EngineMetricsScraper::new("w", &server.url, ranks, FAST).unwrap());
    wait_until("several scrapes", || arrivals.lock().unwrap().len() >= 6).await;
    run.stop().await;
    {
        let arrivals = arrivals.lock().unwrap();
        assert!(arrivals.iter().all(|&(_, c)| c == 1), "overlapping scrapes");
        for pair in arrivals.windows(2) {
            let gap = pair[1].0 - pair[0].0;
            assert!(gap >= Duration::from_millis(30), "{gap:?}");
        }
    }

    // A slow interval is respected even when answers are instant.
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let quick = Server::metrics(move || {
        c.fetch_add(1, Ordering::SeqCst);
        async { (http::StatusCode::OK, GOOD.to_owned()) }
    })
    .await;
    let (g, ranks) = one_rank();
    let timing = ScrapeTiming {
        interval: Duration::from_millis(200),
        ..FAST
    };
    let started = Instant::now();
    let run = Running::start(EngineMetricsScraper::new("w", &quick.url, ranks, timing).unwrap());
    wait_until("a reading", || g.last_reading().is_some()).await;
    wait_until("three scrapes", || count.load(Ordering::SeqCst) >= 3).await;
    assert!(started.elapsed() >= Duration::from_millis(400));
    run.stop().await;
}

#[tokio::test]
async fn a_paced_scraper_takes_its_interval_from_the_fleet_and_leaves_it_when_stopped() {
    let arrivals = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let a = arrivals.clone();
    let server = Server::metrics(move || {
        a.lock().unwrap().push(Instant::now());
        async { (http::StatusCode::OK, GOOD.to_owned()) }
    })
    .await;
    // A fleet of three other scrapers, under 10 scrapes a second: with this one, four, each
    // every 400 ms, where the 10 ms refresh alone would scrape 40 times as often.
    let pace = ScrapePace::new(FAST.interval, std::num::NonZeroU32::new(10));
    let others: Vec<_> = (0..3).map(|_| pace.join()).collect();
    let (g, ranks) = one_rank();
    let scraper = EngineMetricsScraper::new("w", &server.url, ranks, FAST).unwrap();
    let run = Running::start(scraper.paced(pace.clone()));
    wait_until("a reading", || g.last_reading().is_some()).await;
    assert_eq!(pace.interval(), Duration::from_millis(400));
    wait_until("three scrapes", || arrivals.lock().unwrap().len() >= 3).await;
    run.stop().await;
    for pair in arrivals.lock().unwrap().windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap >= Duration::from_millis(400), "{gap:?}");
    }
    // Stopped, it no longer counts; the fleet gone, the interval is the refresh again.
    assert_eq!(pace.interval(), Duration::from_millis(300));
    drop(others);
    assert_eq!(pace.interval(), FAST.interval);
}

#[tokio::test]
async fn a_hanging_engine_times_out_and_shutdown_interrupts_a_scrape() {
    let arrived = Arc::new(AtomicUsize::new(0));
    let a = arrived.clone();
    let server = Server::metrics(move || {
        a.fetch_add(1, Ordering::SeqCst);
        async {
            std::future::pending::<()>().await;
            (http::StatusCode::OK, String::new())
        }
    })
    .await;
    let (g, ranks) = one_rank();
    let timing = ScrapeTiming {
        interval: Duration::from_millis(10),
        timeout: Duration::from_millis(50),
    };
    let scraper = EngineMetricsScraper::new("w", &server.url, ranks, timing).unwrap();
    assert!(
        tokio::time::timeout(timing.timeout, scraper.scrape_once(&build_client()))
            .await
            .is_err()
    );
    let run = Running::start(scraper);
    wait_until("timeouts counted", || run.stats.failed() >= 2).await;
    assert!(g.last_reading().is_none());
    // A long timeout: the scraper is mid-request when shutdown comes, and still stops.
    let (_, ranks) = one_rank();
    let patient = ScrapeTiming {
        timeout: Duration::from_secs(3600),
        ..timing
    };
    run.stop().await;
    let before = arrived.load(Ordering::SeqCst);
    let run2 = Running::start(EngineMetricsScraper::new("w", &server.url, ranks, patient).unwrap());
    wait_until("a request in flight", || {
        arrived.load(Ordering::SeqCst) > before
    })
    .await;
    run2.stop().await;
}
