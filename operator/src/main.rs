//! `dspark-operator`: waits for the leader Lease, applies its CRDs (`--apply-crds`), then runs
//! the DSparkDeployment controller; serves `/metrics` and `/healthz`; shuts down gracefully on
//! SIGTERM (finishing reconciles in flight and releasing the Lease). `dspark-operator probe URL`
//! is the chart's `helm test`: the operator image has no shell and no wget.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use futures::StreamExt;
use kube::runtime::events::{Recorder, Reporter};
use tokio::sync::watch;
use tracing::{error, info, warn};

use dspark_operator::crd::install;
use dspark_operator::leader::LeaderElector;
use dspark_operator::reconcile::cache::Caches;
use dspark_operator::reconcile::names::MANAGER;
use dspark_operator::reconcile::{
    controller, error_policy, reconcile, Context, DEFAULT_CONCURRENCY,
};
use dspark_operator::telemetry::{self, Metrics};

#[derive(Parser, Debug)]
#[command(
    name = "dspark-operator",
    version,
    about = "Kubernetes operator for DSpark engine pools"
)]
struct Args {
    /// Address of the operator's own HTTP server (/metrics, /healthz).
    #[arg(long, env = "DSPARK_OPERATOR_HTTP", default_value = "0.0.0.0:8080")]
    http: String,
    /// Watch only this namespace (default: all).
    #[arg(long, env = "DSPARK_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    #[arg(long, default_value = "dspark-operator-leader")]
    lease_name: String,
    /// This replica's identity in the Lease (default: the host name and process id).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Lease duration in seconds; the holder renews every third of it.
    #[arg(long, default_value_t = 15)]
    lease_seconds: u64,
    /// Act without a Lease (one replica only, e.g. in tests).
    #[arg(long)]
    no_leader_election: bool,
    /// Once leading, apply the CRDs of this build unless the cluster has a newer revision
    /// (Helm never upgrades a chart's CRDs; needs get/create/patch on the two CRDs).
    #[arg(long, env = "DSPARK_APPLY_CRDS")]
    apply_crds: bool,
    /// Reconciles running at once (0: unbounded). A reconcile is a short chain of API
    /// requests; bounding them keeps each one short while a fleet converges instead of
    /// queueing hundreds inside the API server at once.
    #[arg(long, env = "DSPARK_MAX_CONCURRENT_RECONCILES", default_value_t = DEFAULT_CONCURRENCY)]
    max_concurrent_reconciles: u16,
    /// The engine image of deployments without `spec.engine.image`, on pools without GPUs
    /// (default `dspark/engine:<this operator's version>`).
    #[arg(long, env = "DSPARK_ENGINE_IMAGE")]
    engine_image: Option<String>,
    /// The same on pools that request GPUs (default `dspark/engine-cuda:<version>`).
    #[arg(long, env = "DSPARK_ENGINE_CUDA_IMAGE")]
    engine_cuda_image: Option<String>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// GET URL; print the body and exit 0 on a 2xx answer, else say why and exit 1.
    Probe {
        url: String,
        /// Seconds to wait for the connection and the whole answer.
        #[arg(long, default_value_t = 5)]
        timeout_seconds: u64,
    },
}

/// `dspark-operator probe URL`.
async fn probe(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let client = dspark_operator::http::HttpClient::new(timeout);
    let resp = client
        .send(hyper::Method::GET, url, None, None)
        .await
        .map_err(anyhow::Error::msg)?;
    println!("{}", resp.body.trim_end());
    anyhow::ensure!(
        (200..300).contains(&resp.status),
        "{url} answered {}",
        resp.status
    );
    Ok(())
}

/// Resolves when SIGTERM or Ctrl-C arrives.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "info,kube=warn");
    }
    let args = Args::parse();
    if let Some(Cmd::Probe {
        url,
        timeout_seconds,
    }) = &args.command
    {
        return probe(url, Duration::from_secs(*timeout_seconds)).await;
    }
    // Logs (DSPARK_LOG_FORMAT=json for JSON), and OTLP traces + metrics when OTEL_* asks.
    let _telemetry = dspark_telemetry::init("dspark-operator")?;
    let defaults = dspark_operator::crd::EngineImages::default();
    dspark_operator::crd::EngineImages {
        cpu: args.engine_image.clone().unwrap_or(defaults.cpu),
        cuda: args.engine_cuda_image.clone().unwrap_or(defaults.cuda),
    }
    .install();
    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "local".into());
        format!("{}-{}", host.trim(), std::process::id())
    });
    let config = kube::Config::infer()
        .await
        .context("no Kubernetes configuration (KUBECONFIG or in-cluster)")?;
    let metrics = Arc::new(Metrics::default());
    let client = telemetry::counted_client(config, metrics.clone())?;
    dspark_operator::telemetry::export_otel(&metrics);

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        info!("shutdown requested");
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let listener = tokio::net::TcpListener::bind(&args.http)
        .await
        .with_context(|| format!("binding the operator's HTTP server to {}", args.http))?;
    info!(addr = %args.http, "serving /metrics and /healthz");
    let server = axum::serve(listener, telemetry::router(metrics.clone()))
        .with_graceful_shutdown(stopped(stop_rx.clone()));
    tokio::spawn(async move {
        if let Err(e) = server.await {
            error!("HTTP server failed: {e}");
        }
    });

    let lease = Duration::from_secs(args.lease_seconds.max(3));
    let elector = (!args.no_leader_election).then(|| {
        Arc::new(LeaderElector::new(
            client.clone(),
            &args.lease_namespace,
            &args.lease_name,
            &identity,
            lease,
        ))
    });
    if let Some(el) = &elector {
        info!(identity = el.identity(), lease = %args.lease_name, "waiting for leadership");
        loop {
            if *stop_rx.borrow() {
                return Ok(());
            }
            match el.try_acquire_or_renew().await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => warn!("leader election: {e}"),
            }
            tokio::select! {
                _ = tokio::time::sleep(el.renew_period()) => {}
                _ = stopped(stop_rx.clone()) => return Ok(()),
            }
        }
        info!(identity = el.identity(), "acquired leadership");
    }
    metrics.leader.store(true, Ordering::Relaxed);
    if args.apply_crds {
        match install::ensure(&client, Duration::from_secs(60)).await {
            Ok(outcomes) => info!(?outcomes, "CRDs checked"),
            // Not fatal: the CRDs installed (by Helm or by hand) still serve; the log says why
            // new fields may be missing from them.
            Err(e) => warn!(
                "could not apply the CRDs ({e}); reconciling with the CRDs as installed \
                 (apply crds/ by hand: kubectl apply --server-side -f crds/)"
            ),
        }
    }

    let controller = controller(&client, args.namespace.as_deref()).with_config(
        kube::runtime::controller::Config::default().concurrency(args.max_concurrent_reconciles),
    );
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: Some(identity.clone()),
        },
    );
    let ctx = Arc::new(Context::new(
        client.clone(),
        recorder,
        metrics.clone(),
        controller.store(),
        Caches::start(&client, args.namespace.as_deref()),
    ));

    // Leadership lost (renewal failed for a whole lease duration): stop acting at once.
    let (lost_tx, lost_rx) = watch::channel(false);
    if let Some(el) = elector.clone() {
        tokio::spawn(async move {
            let mut last_ok = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(el.renew_period()).await;
                match el.try_acquire_or_renew().await {
                    Ok(true) => last_ok = tokio::time::Instant::now(),
                    Ok(false) => {
                        let _ = lost_tx.send(true);
                        return;
                    }
                    Err(e) => warn!("renewing the lease: {e}"),
                }
                if last_ok.elapsed() >= lease {
                    let _ = lost_tx.send(true);
                    return;
                }
            }
        });
    }
    let lost = stopped(lost_rx.clone());
    let stop = stopped(stop_rx.clone());
    controller
        .graceful_shutdown_on(async move {
            tokio::select! {
                _ = stop => {}
                _ = lost => warn!("leadership lost; stopping"),
            }
        })
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                warn!("controller: {e}");
            }
        })
        .await;
    metrics.leader.store(false, Ordering::Relaxed);
    if *lost_rx.borrow() {
        anyhow::bail!("lost the leader Lease; exiting so that a fresh replica can campaign");
    }
    if let Some(el) = &elector {
        el.release().await.context("releasing the leader Lease")?;
        info!("released the leader Lease");
    }
    Ok(())
}
