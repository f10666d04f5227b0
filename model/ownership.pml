/*
 * The shardrun ownership protocol, for spin.
 *
 * The unit of ownership is a shard of a capability group (shard.GroupOf):
 * the runners that serve the same queues and handle the same kinds. Each
 * runner has one lease and one owner key, owners/<group>/<runner>, naming
 * the shards it holds in its group with their epochs; it acquires with a
 * put conditioned on no key of its group having changed since its view.
 * Each unit has its fence in PostgreSQL (shard_fences keyed (grp, shard)).
 *
 * By default (GROUPS 0) one group of two runners shares one shard whose one
 * task (two with OPEN_TX) they execute; with GROUPS 1, runners 0 and 1 form group A and
 * runner 2 group B, each group owns the shard on its own, and the shard
 * has two tasks: task 0 of a kind only A handles, task 1 of a kind both
 * handle (a lane both groups claim from). Time is discrete: every global
 * tick, etcd counts leases down and each runner's local clock advances (or,
 * for a slow clock, may lag within a bound). All deadlines are kept as
 * countdowns relative to now, so the state space is finite.
 * model/README.md maps every process and variable to the Go code.
 *
 * Parameters (spin -D...):
 *   TTL      lease TTL in ticks                          (shard.Config.LeaseTTL)
 *   MARGIN   detach at deadline - MARGIN                 (shard.Config.DetachMargin)
 *   LAG      how far a runner's clock may fall behind real time over one
 *            keep-alive interval (clock-rate error x TTL)
 *   PAUSE    longest process pause (GC, SIGSTOP): the ticks at which the
 *            paused runner takes no step and its timer does not fire
 *   WINDOW   recovery window, in ticks                   (detach.Config.RecoveryWindow)
 *   FAULTS   1: keep-alives may be lost or delayed, runners paused, detached
 *            by hand; 0: none of that, keep-alives on schedule (Progress)
 *   FAULTY   which runners the faults hit, a bit mask (default: all)
 *   DELAYS   0: a keep-alive the faults hit is lost, never delayed across
 *            a tick
 *   KA_FAULTS 0: no keep-alive is lost or delayed (the other faults remain)
 *   RECEIPT_BUG  1: the deadline counts from the keep-alive's receipt
 *            instead of its send time (the mistake the design warns about)
 *   SPLIT_RAISE 1: the new owner raises the fence and requeues the orphans
 *            in two transactions instead of one (the writes, which match
 *            the claim row and take no lock on the fence, then land between)
 *   CLAIM_NOLOCK 1: claims check the fence and take the task in two steps,
 *            as without the FOR SHARE lock on the fence row
 *   MANUAL   1: an operator may detach each runner by hand once, and attach it
 *   IDLE_PAUSE 1: pauses start only while the runner executes nothing, to
 *            check new work alone: a runner waking from any pause must
 *            start nothing past its detach point
 *   CLAIM_NO_CLOCK 1: claims check only the detach flag, not the lease
 *            clock (the mistake that let a woken runner start work before
 *            its timer detached it)
 *   MAXACQ   acquisitions explored, per group (revisions only grow; this
 *            bounds them)
 *   GROUPS   1: two capability groups (three runners, two tasks), above
 *   ONLY_B   1 (GROUPS): group A's runners are stopped by an operator from
 *            the start and never attach: only task 1 can run
 * The weakened group protocols (GROUPS 1):
 *   OWN_KEY_ONLY 1: an acquisition is conditioned on the runner's own key
 *            only, not on every owner key of its group
 *   SHARED_FENCE 1: one fence per shard for all groups (shard_fences keyed
 *            by shard alone), and a raise requeues every older claim of the
 *            shard, whatever its group
 *   CLAIM_UNOWNED 1: group B's runner claims without holding its group's
 *            unit (from a shard B's unit is not its in)
 *   CLAIM_ANY_KIND 1: claims take the lanes of every kind, not only those
 *            of the runner's kinds
 * The slow parts (issue 39), in the one-group model (GROUPS 0):
 *   WATCH    1: each runner's view of the other member's owner key comes
 *            from its watch, which delivers the events late, several at
 *            once, in batches whose header (etcd's current revision) may be
 *            ahead of their last event; etcd's revision counts every change
 *            under the cluster prefix, and the acquiring Txn compares the
 *            ModRevisions of the group's keys with the runner's groupRev
 *   NOISE    (WATCH) other writes under the cluster prefix (runner keys,
 *            other groups), each one revision in every watch (default 1)
 *   HEADER_REV 1 (WATCH): groupRev takes a batch's header revision, not
 *            the revision of its last event (the code before the fix)
 *   AHEAD    1: a runner may claim a task ahead of need: it waits in the
 *            executor's buffer, then starts (or is given back)
 *   AHEAD_NO_CHECK 1 (AHEAD): a buffered task starts unless its term's
 *            context ended, without Ownership.Workable's checks of the lease
 *            clock and the term (the code before the fix)
 *   PATIENCE (AHEAD; default 1 but with AHEAD_NO_CHECK) 1: a buffered task
 *            may also go back at any moment, as one that waited longer than
 *            aheadPatience does; 0 for Progress (the patience is ten times
 *            the wait expected: a task does not go back forever)
 *   OPEN_TX  1: two tasks; one handler's transaction marks its claim row
 *            completed (CompleteTx) and holds the row's lock until it ends:
 *            it commits, or PostgreSQL ends it after the bound
 *            (HandlerTxTimeout: idle_in_transaction_session_timeout and
 *            the like) and it rolls back
 *   TX_FOREVER 1 (OPEN_TX): that transaction never ends (OthersProgress)
 *   FREEZE   1 (OPEN_TX): the runner whose handler holds it may freeze for
 *            good (SIGSTOP): its lease expires, its handlers never run
 *            again, its session and the transaction stay
 *   WAIT_LOCKS 1 (OPEN_TX): the fence raise and orphan requeue wait for a
 *            locked claim row instead of skipping it (the code before the fix)
 *   WRITE_FENCE (default OPEN_TX) 1: the runner's writes of its claims
 *            also read that the unit's fence still holds their epoch
 *            (fenceHolds); 0: they match the claim row only, which is
 *            enough while every raise requeues all older claims at once
 *            (leaving the read out only adds behaviours)
 */

#ifndef TTL
#define TTL 5
#endif
#ifndef MARGIN
#define MARGIN 2
#endif
#ifndef LAG
#define LAG 0
#endif
#ifndef PAUSE
#define PAUSE 0
#endif
#ifndef WINDOW
#define WINDOW 1
#endif
#ifndef FAULTS
#define FAULTS 1
#endif
#ifndef FAULTY
#define FAULTY 7
#endif
#ifndef DELAYS
#define DELAYS 1
#endif
#ifndef KA_FAULTS
#define KA_FAULTS 1
#endif
#ifndef ONLY_B
#define ONLY_B 0
#endif
#ifndef RECEIPT_BUG
#define RECEIPT_BUG 0
#endif
#ifndef SPLIT_RAISE
#define SPLIT_RAISE 0
#endif
#ifndef CLAIM_NOLOCK
#define CLAIM_NOLOCK 0
#endif
#ifndef MANUAL
#define MANUAL 0
#endif
#ifndef IDLE_PAUSE
#define IDLE_PAUSE 0
#endif
#ifndef CLAIM_NO_CLOCK
#define CLAIM_NO_CLOCK 0
#endif
#ifndef MAXACQ
#define MAXACQ 2
#endif
#ifndef GROUPS
#define GROUPS 0
#endif
#ifndef OWN_KEY_ONLY
#define OWN_KEY_ONLY 0
#endif
#ifndef SHARED_FENCE
#define SHARED_FENCE 0
#endif
#ifndef CLAIM_UNOWNED
#define CLAIM_UNOWNED 0
#endif
#ifndef CLAIM_ANY_KIND
#define CLAIM_ANY_KIND 0
#endif
#ifndef WATCH
#define WATCH 0
#endif
#ifndef NOISE
#define NOISE WATCH
#endif
#ifndef HEADER_REV
#define HEADER_REV 0
#endif
#ifndef AHEAD
#define AHEAD 0
#endif
#ifndef AHEAD_NO_CHECK
#define AHEAD_NO_CHECK 0
#endif
#ifndef OPEN_TX
#define OPEN_TX 0
#endif
#ifndef TX_FOREVER
#define TX_FOREVER 0
#endif
#ifndef FREEZE
#define FREEZE 0
#endif
#ifndef WAIT_LOCKS
#define WAIT_LOCKS 0
#endif
#ifndef WRITE_FENCE
#define WRITE_FENCE OPEN_TX
#endif
#ifndef PATIENCE
#define PATIENCE (AHEAD && !AHEAD_NO_CHECK)
#endif
#define PERIOD 1   /* keep-alive interval in ticks (TTL/3 rounded down, at least 1) */

#if GROUPS && CLAIM_NOLOCK
#error CLAIM_NOLOCK is a check of the one-group model
#endif
#if GROUPS && (WATCH || AHEAD || OPEN_TX)
#error WATCH, AHEAD and OPEN_TX are checks of the one-group model
#endif
#if (HEADER_REV && !WATCH) || (AHEAD_NO_CHECK && !AHEAD) || ((TX_FOREVER || FREEZE || WAIT_LOCKS) && !OPEN_TX)
#error HEADER_REV needs WATCH, AHEAD_NO_CHECK needs AHEAD, TX_FOREVER, FREEZE and WAIT_LOCKS need OPEN_TX
#endif

#define FREE 255

/* Runners, tasks and groups. GRP(i) is runner i's group; CAN_RUN(g, t):
 * group g handles the kind of task t (serves its queue, has its handler). */
#if GROUPS
#define N  3
#define NT 2
#define NG 2
#define GRP(i) grp[i]
#define CAN_RUN(g, t) ((g) == 0 || (t) == 1)
#else
#define N  2
#if OPEN_TX
#define NT 2
#else
#define NT 1
#endif
#define NG 1
#define GRP(i) 0
#define CAN_RUN(g, t) true
#endif

/* The fence a unit's claims and raises use: the unit's own, or, weakened,
 * the shard's one fence. */
#if SHARED_FENCE
#define FI(g) 0
#define SAME_UNIT(g, h) true
#else
#define FI(g) (g)
#define SAME_UNIT(g, h) ((g) == (h))
#endif

/* Task states (tasks.State). */
#define READY   0
#define RUNNING 1
#define DONE    2

/* Keep-alive in flight (shard/keeper.go): none, request on its way to
 * etcd, response on its way back, "lease not found" on its way back. */
#define KA_NONE 0
#define KA_REQ  1
#define KA_RESP 2
#define KA_GONE 3

/* ---- etcd ---- */
byte lease_left[N];       /* server ticks until the runner's lease expires; 0: expired */
byte okey[N];             /* owners/<group>/<runner i>: the epoch it names shard 0 with
                           * (the revision of the put that added it), 0: names nothing
                           * (with one shard: no key). With one shard it is also the
                           * key's ModRevision. */
byte rev;                 /* etcd's revision counter, counting the puts (a delete
                           * changes no key's ModRevision, so no comparison sees it) */
#if GROUPS
byte acq[NG];             /* acquisitions per group, bounded by MAXACQ */
#endif

/* ---- PostgreSQL ---- */
byte fence[NG];           /* shard_fences.epoch of unit (group, shard 0) */
byte task_state[NT];      /* READY: a task_ready entry; RUNNING: a task_claims row */
byte task_epoch[NT];      /* task_claims.epoch (a requeue always comes with a new
                           * epoch here, so the epoch stands in for the attempt) */
byte task_owner[NT];      /* task_claims.owner */
byte task_grp[NT];        /* task_claims.grp: the unit it was claimed under */
byte outcomes[NT];        /* terminal outcomes recorded */

/* ---- runners ---- */
bool attached[N];         /* detach.Machine: !IsDetached() */
bool sticky[N];           /* manual detach waiting for Attach */
byte dl[N];               /* local countdown to the lease deadline (LeaseClock.Deadline);
                           * every value at or below MARGIN means "detach now" and is kept as 0 */
byte ka[N];               /* keep-alive in flight */
byte ka_age[N];           /* local ticks since that keep-alive was sent, capped at TTL - MARGIN
                           * (an answer that old cannot keep the runner attached) */
byte since_send[N];       /* local ticks since the last send (the keep-alive timer) */
byte lag_d[N];            /* clock lag since the send that set the deadline */
byte lag_r[N];            /* clock lag since the send of the keep-alive in flight */
byte paused[N];           /* ticks of pause left */
byte healthy[N];          /* consecutive healthy ticks while detached */
bool owns[N];             /* holds its group's unit (a term in the ledger) */
byte epoch[N];            /* its epoch */
bool fenced[N];           /* raised the fence for it (executor.fenced) */
bool requeued[N];         /* requeued the orphans of older epochs */
bool ex[N * NT];          /* ex[i*NT + t]: a handler of task t is running on runner i */
byte cl_epoch[N * NT];    /* epoch of the claim it runs */
bool checked[N * NT];     /* CLAIM_NOLOCK: read the fence, about to take the task */
bool manual_used[N];      /* the one manual detach per runner was used */
bool can_pause[N];        /* the timer has run since the last pause, so a new
                           * pause may start (pauses do not chain into longer ones) */
#if GROUPS
byte grp[N];              /* the runner's group (constant: 0, 0, 1) */
bool vfree[N];            /* the runner's view of its group's owner keys (as of
                           * Manager.groupRev) names no holder of the unit; kept
                           * false while the runner holds the unit (it acquires
                           * nothing then) */
#endif

#if WATCH
/* ---- the group's owner keys as etcd's history, and each runner's watch
 * of them (shard/watch.go, Manager.apply) ---- */
#define NREV (2 * MAXACQ + NOISE + 1)  /* each put is deleted at most once */
#define OTHER(i) (1 - (i))             /* the group's other member */
byte acqs;                /* acquisitions, bounded by MAXACQ */
byte noise;               /* other writes under the prefix so far, up to NOISE */
byte ev_who[NREV];        /* the change at revision r: 1 + the runner whose owner key it
                           * changed, or N + 1 (another key under the prefix) */
bool ev_put[NREV];        /* ... a put naming the unit (its epoch is r), or the key's
                           * deletion (a release, or the lease's expiry) */
byte kmod[N];             /* revision of the last change of runner i's owner key */
byte drev[N];             /* runner i's watch has delivered every event up to here */
byte grev[N];             /* Manager.groupRev: the view of the group's keys is taken as
                           * complete up to here; the Txn compares against it */
byte vrev[N];             /* the view of the other member's key: the revision of the last
                           * change of it the view holds (0: none) */
/* runner i's view names the other member as the unit's holder */
#define VNAMES(i) (vrev[i] != 0 && ev_put[vrev[i]])
#endif

#if AHEAD
bool ahead[N * NT];       /* ahead[i*NT + t]: task t, claimed by runner i (cl_epoch), waits
                           * in its executor's buffer (ahead.go) for a free worker */
#define AHEAD_OF(i, t) ahead[(i) * NT + (t)]
#else
#define AHEAD_OF(i, t) false
#endif

#if OPEN_TX
#define FOREVER 255       /* paused[i]: frozen for good */
/* The one handler transaction of a run that marks its claim row (CompleteTx). */
#define TX_NONE   0       /* not yet */
#define TX_OPEN   1       /* the mark is written, not committed: the row is locked */
#define TX_MARKED 2       /* committed: the claim row carries the completion mark */
#define TX_ROLLED 3       /* ended by PostgreSQL, rolled back: no mark; the handler's
                           * commit failed and it returns an error */
#define TX_OVER   4       /* the claim it was about has ended */
byte tx;
byte txtask;              /* its task */
byte txowner;             /* the runner whose handler opened it */
bool pending[N];          /* the raise skipped a locked orphan (Orphans.Pending): requeue
                           * it later (RequeueOrphans) */
bool froze;               /* FREEZE: the one freeze was used */
#define LOCKED(t) (tx == TX_OPEN && txtask == (t))
#define MARKED(t) (tx == TX_MARKED && txtask == (t))
/* runner i's handler of task t is in that open transaction */
#define IN_TX(i, t) (LOCKED(t) && txowner == (i))
#else
#define LOCKED(t) false
#define IN_TX(i, t) false
#endif

/* The properties, each asserted where it can become false (a named
 * variable, so that a counterexample says which). */
bool NoDoubleExecution = true, NoStaleWrite = true, OutcomeOnce = true, RunsWhereItCan = true;
bool NoStartPastDetach = true;
#if WATCH
/* OneNamer: never two owner keys of the group name the unit at once (the
 * mutual exclusion etcd gives, before any fence). Only an acquisition puts
 * a key naming it. */
bool OneNamer = true;
#ifdef NO_ONE_NAMER_CHECK
#define check_one_namer() skip
#else
#define check_one_namer() OneNamer = (okey[0] == 0 || okey[1] == 0); assert(OneNamer)
#endif
#endif

#define EXEC(i, t) ex[(i) * NT + (t)]
#define ATT_EXEC(i, t) (attached[i] && EXEC(i, t))

/* NoDoubleExecution: never two attached runners executing one task at
 * once. It can only become false at a claim of that task or a start of it
 * from the buffer (every other step clears attached or ex, and
 * re-attaching requires owning nothing, hence running nothing), so
 * asserting it after each of those checks it in every state. */
#if GROUPS
#define double_exec(t) ((ATT_EXEC(0, t) && ATT_EXEC(1, t)) || (ATT_EXEC(0, t) && ATT_EXEC(2, t)) || \
                        (ATT_EXEC(1, t) && ATT_EXEC(2, t)))
#else
#define double_exec(t) (ATT_EXEC(0, t) && ATT_EXEC(1, t))
#endif
#ifdef NO_DOUBLE_EXEC_CHECK
#define check_double_exec(t) skip
#else
#define check_double_exec(t) NoDoubleExecution = !double_exec(t); assert(NoDoubleExecution)
#endif

/* NoStaleWrite: no write lands with an epoch older than the fence of the
 * unit its claim was made under. */
#ifdef NO_STALE_WRITE_CHECK
#define check_stale_write(i, t) skip
#else
#define check_stale_write(i, t) NoStaleWrite = (cl_epoch[(i) * NT + (t)] >= fence[FI(task_grp[t])]); assert(NoStaleWrite)
#endif

/* NoStartPastDetach: a handler starts (a claim that starts it at once, or
 * a start from the buffer) only while the runner's lease clock is before
 * its detach point. check_start(i) ends with its own separator, so that
 * without the check it leaves no statement (a skip would add states to
 * the searches of the model before it). */
#ifdef NO_START_CHECK
#define check_start(i)
#else
#define check_start(i) NoStartPastDetach = (dl[i] != 0); assert(NoStartPastDetach);
#endif

/* The unit's fence holds the epoch runner i's claim of task t was made
 * under (fenceHolds), where writes read it. */
#if WRITE_FENCE
#define FENCE_HOLDS(i, t) (fence[FI(task_grp[t])] == cl_epoch[(i) * NT + (t)])
#else
#define FENCE_HOLDS(i, t) true
#endif

/* Whether runner i executes nothing; whether every task is done. */
#if NT > 1
#define IDLE(i) (!EXEC(i, 0) && !EXEC(i, 1))
#define ALL_DONE (task_state[0] == DONE && task_state[1] == DONE)
#define NONE_AHEAD(i) (!AHEAD_OF(i, 0) && !AHEAD_OF(i, 1))
#else
#define IDLE(i) (!EXEC(i, 0))
#define ALL_DONE (task_state[0] == DONE)
#define NONE_AHEAD(i) (!AHEAD_OF(i, 0))
#endif
#if ONLY_B
#define RUNNABLE_DONE (task_state[1] == DONE)
#else
#define RUNNABLE_DONE ALL_DONE
#endif
#if OPEN_TX
/* Every task but the one an open transaction holds is done. */
#define OTHERS_DONE ((task_state[0] == DONE || LOCKED(0)) && (task_state[1] == DONE || LOCKED(1)))
/* An orphan runner i's raise must requeue is locked. */
#define ORPHAN_LOCKED(i) (tx == TX_OPEN && task_state[txtask] == RUNNING && task_epoch[txtask] < epoch[i])
#else
#define ORPHAN_LOCKED(i) false
#endif

/* Faults hit runner i. PROMPT: no keep-alive of a runner they do not hit
 * is in flight. */
#define FAULTY_RUNNER(i) (FAULTS && ((FAULTY >> (i)) & 1))
#define DELAYED(i) (KA_FAULTS && DELAYS && FAULTY_RUNNER(i))
#if GROUPS
#define PROMPT ((DELAYED(0) || ka[0] == KA_NONE) && (DELAYED(1) || ka[1] == KA_NONE) && \
                (DELAYED(2) || ka[2] == KA_NONE))
#else
#define PROMPT ((DELAYED(0) || ka[0] == KA_NONE) && (DELAYED(1) || ka[1] == KA_NONE))
#endif

/* No key of group g names the unit. */
#if GROUPS
#define GFREE(g) ((grp[0] != (g) || okey[0] == 0) && (grp[1] != (g) || okey[1] == 0) && (grp[2] != (g) || okey[2] == 0))
#else
#define GFREE(g) (okey[0] == 0 && okey[1] == 0)
#endif

/* The acquiring Txn's comparison, made on a view that named no holder of
 * the unit: no owner key of runner i's group was put after the view
 * (ModRevision of the prefix < groupRev + 1). With one shard a key exists
 * only while it names the unit, so that view held no key of the group, every
 * key of the group that exists now was put after it, and the comparison
 * holds exactly when the unit is free now (a stale view fails it). Weakened:
 * the runner's own key alone, which it does not have. */
#if OWN_KEY_ONLY
#define UNCHANGED(i) (okey[i] == 0)
#else
#define UNCHANGED(i) GFREE(GRP(i))
#endif

/* What a claim requires of the unit: the runner holds its group's unit,
 * raised its fence and requeued the orphans, and the fence still has its
 * epoch (the FOR SHARE lock on the fence row where (shard, epoch, owner)
 * match). */
#define OWN_UNIT(i) (owns[i] && requeued[i] && fence[FI(GRP(i))] == epoch[i])
#if CLAIM_UNOWNED
#define CLAIM_UNIT(i) (GRP(i) == 1 || OWN_UNIT(i))
#else
#define CLAIM_UNIT(i) OWN_UNIT(i)
#endif
#if CLAIM_ANY_KIND
#define RUNS(i, t) true
#else
#define RUNS(i, t) CAN_RUN(GRP(i), t)
#endif

/* requeue(i): the orphans of runner i's unit (claims of its group, on the
 * shard) of epochs older than runner i's go back to ready. A claim row an
 * open transaction locks is skipped (FOR UPDATE SKIP LOCKED) and left
 * pending, to requeue again later. */
inline requeue_task(i, t) {
	if
	:: task_state[t] == RUNNING && SAME_UNIT(task_grp[t], GRP(i)) && task_epoch[t] < epoch[i] && !LOCKED(t) ->
#if OPEN_TX
		if
		:: MARKED(t) ->                             /* completed with the handler's mark */
			tx = TX_OVER; task_state[t] = DONE; outcomes[t]++;
			OutcomeOnce = (outcomes[t] <= 1); assert(OutcomeOnce)
		:: else ->
			if :: tx == TX_ROLLED && txtask == t -> tx = TX_OVER :: else fi;
			task_state[t] = READY; task_owner[t] = FREE; task_grp[t] = 0
		fi
#else
		task_state[t] = READY; task_owner[t] = FREE; task_grp[t] = 0
#endif
#if OPEN_TX
	:: task_state[t] == RUNNING && SAME_UNIT(task_grp[t], GRP(i)) && task_epoch[t] < epoch[i] && LOCKED(t) ->
		pending[i] = true
#endif
	:: else
	fi
}
inline requeue(i) {
	requeue_task(i, 0);
#if NT > 1
	requeue_task(i, 1);
#endif
	requeued[i] = true
}

/* detach(i): the subscriber cancels every term's work at once. */
inline detach(i) {
	attached[i] = false;
	stop_all(i);
	healthy[i] = 0
}

/* The handler of task t is cancelled or done: its claim is forgotten. */
inline stop_exec(i, t) {
	EXEC(i, t) = false;
	cl_epoch[(i) * NT + (t)] = 0
}
inline stop_all(i) {
	stop_exec(i, 0)
#if NT > 1
	; stop_exec(i, 1)
#endif
}

/* The runner no longer holds the unit. */
inline drop(i) {
	owns[i] = false;
	epoch[i] = 0;
	fenced[i] = false;
	requeued[i] = false
#if OPEN_TX
	; pending[i] = false
#endif
}

#if WATCH
/* A change of runner j's owner key at a new revision: a put naming the
 * unit, or the key's deletion. */
inline key_event(j, put) {
	rev++; ev_who[rev] = j + 1; ev_put[rev] = put; kmod[j] = rev
}

/* Runner i's watch delivers a batch: the events after the last one it
 * delivered, up to some revision, as one update (Manager.apply). The
 * view keeps the newest change of the other member's key it has seen
 * (view.set ignores an older one). The view is complete up to the batch's
 * last event; HEADER_REV takes the header's revision, etcd's current one,
 * which may be ahead of it. */
inline watch_batch(i) {
	do
	:: drev[i] < rev ->
		drev[i]++;
		if
		:: ev_who[drev[i]] == OTHER(i) + 1 && drev[i] > vrev[i] -> vrev[i] = drev[i]
		:: else
		fi;
		if
		:: true -> break           /* the batch ends here */
		:: drev[i] < rev           /* it has the next event too */
		fi
	:: else -> break
	od;
#if HEADER_REV
	if :: grev[i] < rev -> grev[i] = rev :: else fi
#else
	if :: grev[i] < drev[i] -> grev[i] = drev[i] :: else fi
#endif
}

/* The Else branch of an acquiring or releasing Txn reads the group's keys
 * at the Txn's revision: a complete read, so the view is complete up to it
 * (loadGroup). */
inline read_group(i) {
	vrev[i] = kmod[OTHER(i)]; grev[i] = rev
}
#endif

/* Keep-alive finished (answered, lost or abandoned). */
inline ka_done(i) {
	ka[i] = KA_NONE;
	ka_age[i] = 0;
	lag_r[i] = 0
}

/* One tick of time for runner i's local clock: it advances by one, or, for
 * a slow clock within the lag bound, not at all. */
inline local_tick(i) {
	if
	:: lag_d[i] < LAG && (ka[i] == KA_NONE || lag_r[i] < LAG) ->
		lag_d[i]++;
		if :: ka[i] != KA_NONE -> lag_r[i]++ :: else fi
	:: true ->
		if :: dl[i] > MARGIN + 1 -> dl[i]-- :: else -> dl[i] = 0 fi;
		if :: ka[i] != KA_NONE && ka_age[i] < TTL - MARGIN -> ka_age[i]++ :: else fi;
		if :: since_send[i] < PERIOD -> since_send[i]++ :: else fi
	fi
}

/* etcd expires a lease no earlier than TTL after it received the last
 * keep-alive, and deletes the keys attached to it: the runner's owner key. */
inline server_tick(i) {
	if
	:: lease_left[i] > 0 ->
		lease_left[i]--;
		if
		:: lease_left[i] == 0 ->
#if WATCH
			if :: okey[i] != 0 -> key_event(i, false) :: else fi;
#endif
			okey[i] = 0
		:: else
		fi
	:: else
	fi
}

/* The runner's timer fires at deadline - MARGIN (keeper.check), unless the
 * process is paused; recovery counts healthy ticks (detach.Machine). */
inline runner_timers(i) {
	if
	:: paused[i] > 0 ->
#if FREEZE
		if :: paused[i] != FOREVER -> paused[i]-- :: else fi   /* frozen for good: nothing */
#else
		paused[i]--
#endif
	:: else ->
		can_pause[i] = true;              /* a pause ended: the timer ran once */
		if :: attached[i] && dl[i] == 0 -> detach(i) :: else fi;
		/* the keep-alive timer: one request every PERIOD local ticks */
		if
		:: ka[i] == KA_NONE && since_send[i] >= PERIOD ->
			ka[i] = KA_REQ; ka_age[i] = 0; since_send[i] = 0; lag_r[i] = 0
		:: else
		fi;
		if
		:: !attached[i] && dl[i] != 0 && healthy[i] < WINDOW -> healthy[i]++
		:: !attached[i] && dl[i] == 0 -> healthy[i] = 0
		:: else
		fi
	fi
}

active proctype clock() {
	do
	:: atomic {
		/* without faults the network is prompt: no keep-alive is in flight
		 * across a tick */
		PROMPT;
		/* once every task is done nothing that follows can break a
		 * property: time stops (pan -E: stopping is not a deadlock) */
		!ALL_DONE;
		server_tick(0); server_tick(1);
#if GROUPS
		server_tick(2);
#endif
		local_tick(0); local_tick(1);
#if GROUPS
		local_tick(2);
#endif
		runner_timers(0); runner_timers(1)
#if GROUPS
		; runner_timers(2)
#endif
	}
#if WATCH
	/* another write under the cluster prefix (a runner key, another
	 * group's owner key): a revision in every watch */
	:: atomic { noise < NOISE -> noise++; rev++; ev_who[rev] = N + 1 }
#endif
	od
}

#if OPEN_TX && !TX_FOREVER
/* The handler's PostgreSQL session: the open transaction ends. Its (slow)
 * COMMIT leaves the mark on the claim row, with the handler's own writes,
 * or PostgreSQL ends it after its bound and it rolls back. The lock kept
 * the row the attempt's until now; the handler returns (an error, when its
 * commit failed), and whoever ends the claim next acts on the mark. A
 * process of its own, so that weak fairness ends it: the bound. */
proctype session() {
	atomic { tx == TX_OPEN ->
		if
		:: tx = TX_MARKED
		:: tx = TX_ROLLED
		fi }
}
#endif

/* The network and the environment of runner i: keep-alive requests and
 * responses arrive (or, with faults, are lost or delayed), the process is
 * paused, an operator detaches it. */
proctype network(byte i) {
	do
	:: atomic { ka[i] == KA_REQ ->          /* etcd receives the keep-alive */
		if
		:: lease_left[i] > 0 -> lease_left[i] = TTL; ka[i] = KA_RESP
		:: else -> ka[i] = KA_GONE
		fi }
#if FAULTS
	:: atomic { KA_FAULTS && FAULTY_RUNNER(i) && ka[i] == KA_REQ -> ka_done(i) }   /* request lost, or the call timed out */
	:: atomic { KA_FAULTS && FAULTY_RUNNER(i) && ka[i] == KA_RESP -> ka_done(i) }  /* response lost */
#endif
	:: atomic { paused[i] == 0 && ka[i] == KA_RESP ->  /* response: deadline = send + TTL */
#if RECEIPT_BUG
		dl[i] = TTL;
#else
		if :: ka_age[i] < TTL - MARGIN -> dl[i] = TTL - ka_age[i] :: else -> dl[i] = 0 fi;
#endif
		lag_d[i] = lag_r[i];
		ka_done(i) }
	:: atomic { paused[i] == 0 && ka[i] == KA_GONE ->  /* lease gone: detach, grant a new one */
		detach(i);
		drop(i);
		lease_left[i] = TTL; dl[i] = TTL; lag_d[i] = 0;
		ka_done(i) }
#if FAULTS && PAUSE > 0
	:: atomic { FAULTY_RUNNER(i) && paused[i] == 0 && can_pause[i] && (!IDLE_PAUSE || IDLE(i)) ->
		paused[i] = PAUSE; can_pause[i] = false }  /* GC pause, SIGSTOP: PAUSE ticks of timer checks missed */
#endif
#if FREEZE
	/* The runner whose handler holds the open transaction freezes for good
	 * (SIGSTOP): no keep-alive, no timer, no step, and none of its
	 * handlers runs again, as if it had crashed; but its PostgreSQL
	 * session and the transaction stay open. (Waking from a pause beyond
	 * the margin is the at-least-once limit, checked above.) */
	:: atomic { !froze && tx == TX_OPEN && txowner == i && paused[i] == 0 && ka[i] == KA_NONE ->
		froze = true; paused[i] = FOREVER; detach(i) }
#endif
#if FAULTS && MANUAL
	/* POST /admin/detach, then /admin/attach: once per runner (it only
	 * detaches; more rounds add states, not behaviours) */
	:: atomic { FAULTY_RUNNER(i) && attached[i] && !sticky[i] && !manual_used[i] -> sticky[i] = true; manual_used[i] = true; detach(i) }
	:: atomic { sticky[i] -> sticky[i] = false }
#endif
	od
}

/* Claim task t and begin it under a Hold: attached, and the lease clock
 * before its detach point (dl != 0), checked by the claim itself and not
 * left to the timer (shard.Manager.mayWork); only a lane of the runner's
 * kinds, in a shard whose unit of its group it holds, fenced (Store.Claim,
 * under FOR SHARE of the unit's fence row). The lane entry is deleted by
 * one claim: the step is atomic on it. */
inline claim(i, t) {
	atomic { paused[i] == 0 && attached[i] && (CLAIM_NO_CLOCK || dl[i] != 0) &&
	         CLAIM_UNIT(i) && RUNS(i, t) && !EXEC(i, t) && !AHEAD_OF(i, t) && task_state[t] == READY ->
		task_state[t] = RUNNING; task_epoch[t] = epoch[i]; task_owner[t] = i; task_grp[t] = GRP(i);
		EXEC(i, t) = true; cl_epoch[(i) * NT + (t)] = epoch[i];
		RunsWhereItCan = CAN_RUN(GRP(i), t); assert(RunsWhereItCan);
		check_start(i)
		check_double_exec(t) }
}

#if AHEAD
/* Claim task t ahead of need (the same claim, under the same checks): it
 * waits in the buffer for a free worker instead of starting. */
inline claim_ahead(i, t) {
	atomic { paused[i] == 0 && attached[i] && (CLAIM_NO_CLOCK || dl[i] != 0) &&
	         CLAIM_UNIT(i) && RUNS(i, t) && !EXEC(i, t) && !AHEAD_OF(i, t) && task_state[t] == READY ->
		task_state[t] = RUNNING; task_epoch[t] = epoch[i]; task_owner[t] = i; task_grp[t] = GRP(i);
		AHEAD_OF(i, t) = true; cl_epoch[(i) * NT + (t)] = epoch[i] }
}

/* Whether a buffered task may start now. Ownership.Workable: attached, the
 * lease clock before its detach point (the claim's own check), and the
 * term it was claimed under still held and fenced (not releasing, not
 * ended). Weakened (the pool before the fix): its term's context has not
 * ended, which only a detach or the term's end does. */
#if AHEAD_NO_CHECK
#define WORKABLE(i, t) (attached[i] && owns[i] && epoch[i] == cl_epoch[(i) * NT + (t)])
#else
#define WORKABLE(i, t) (attached[i] && dl[i] != 0 && owns[i] && fenced[i] && epoch[i] == cl_epoch[(i) * NT + (t)])
#endif

/* A worker frees: the buffered task starts, if it may (startNext). */
inline start_ahead(i, t) {
	atomic { paused[i] == 0 && AHEAD_OF(i, t) && WORKABLE(i, t) ->
		AHEAD_OF(i, t) = false; EXEC(i, t) = true;
		check_start(i)
		check_double_exec(t) }
}

/* Otherwise it goes back (Unclaim, fenced on the claim row like Complete:
 * ready again, same attempt): at the start, and as soon as its term starts
 * to move or ends, or the runner detaches (the claimer's round that
 * Changes() wakes, or the detach); and, PATIENCE, at any moment, as after
 * waiting longer than aheadPatience (ahead.sweep). */
inline give_back(i, t) {
	atomic { paused[i] == 0 && AHEAD_OF(i, t) && (!WORKABLE(i, t) || PATIENCE) ->
		if
		:: task_state[t] == RUNNING && task_owner[t] == i && task_epoch[t] == cl_epoch[(i) * NT + (t)] && FENCE_HOLDS(i, t) ->
			check_stale_write(i, t);
			task_state[t] = READY; task_owner[t] = FREE; task_grp[t] = 0
		:: else
		fi;
		AHEAD_OF(i, t) = false; cl_epoch[(i) * NT + (t)] = 0 }
}
#endif

#if OPEN_TX
/* The handler of task t records its completion in its own transaction
 * (CompleteTx): it marks the claim row, matched and fenced like the
 * runner's writes, and holds the row's lock until the transaction ends.
 * The mark changes no task: whoever ends the claim afterwards completes
 * the task with it. The handler has not returned meanwhile. */
inline open_tx(i, t) {
	atomic { paused[i] == 0 && tx == TX_NONE && EXEC(i, t) &&
	         task_state[t] == RUNNING && task_owner[t] == i && task_epoch[t] == cl_epoch[(i) * NT + (t)] && FENCE_HOLDS(i, t) ->
		check_stale_write(i, t);
		tx = TX_OPEN; txtask = t; txowner = i }
}
#endif

/* Without the lock the claim reads the fence, then takes the task: the
 * raise and requeue can land in between. */
inline claim_nolock(i, t) {
	atomic { paused[i] == 0 && attached[i] && (CLAIM_NO_CLOCK || dl[i] != 0) &&
	         OWN_UNIT(i) && RUNS(i, t) && !EXEC(i, t) && !checked[(i) * NT + (t)] ->
		checked[(i) * NT + (t)] = true }
}
inline take_checked(i, t) {
	atomic { checked[(i) * NT + (t)] ->
		if
		:: task_state[t] == READY ->
			task_state[t] = RUNNING; task_epoch[t] = epoch[i]; task_owner[t] = i; task_grp[t] = GRP(i);
			EXEC(i, t) = true; cl_epoch[(i) * NT + (t)] = epoch[i];
			check_double_exec(t)
		:: else
		fi;
		checked[(i) * NT + (t)] = false }
}

/* Complete: matches the claim row (owner, epoch, attempt) and takes no
 * lock on the fence (WRITE_FENCE: reads that it holds the claim's epoch);
 * one statement, atomic on that row. A refusal means the unit's fence
 * moved on (FenceLost): the term is cancelled. A handler whose own
 * transaction is still open has not returned: nothing is written for it
 * until that transaction ends. */
inline complete(i, t) {
	atomic { paused[i] == 0 && EXEC(i, t) && !IN_TX(i, t) ->
		if
		:: task_state[t] == RUNNING && task_owner[t] == i && task_epoch[t] == cl_epoch[(i) * NT + (t)] && FENCE_HOLDS(i, t) ->
			check_stale_write(i, t);
#if OPEN_TX
			if
			:: tx == TX_ROLLED && txtask == t && txowner == i ->
				/* the handler's commit failed: Fail, ready again */
				tx = TX_OVER; task_state[t] = READY; task_owner[t] = FREE; task_grp[t] = 0
			:: else ->
				if :: MARKED(t) -> tx = TX_OVER :: else fi;   /* claims.Completed */
				task_state[t] = DONE; outcomes[t]++;
				OutcomeOnce = (outcomes[t] <= 1); assert(OutcomeOnce)
			fi
#else
			task_state[t] = DONE; outcomes[t]++;
			OutcomeOnce = (outcomes[t] <= 1); assert(OutcomeOnce)
#endif
		:: else -> drop(i); stop_all(i)
		fi;
		stop_exec(i, t) }
}

/* Runner i's own work: re-attaching, ownership of its group's unit and the
 * executor. A separate process from its network, so that weak fairness
 * makes it take its enabled steps. */
proctype worker(byte i) {
	do
	/* ---- re-attach after the recovery window (detach.Machine.Healthy) ---- */
	:: atomic { paused[i] == 0 && !attached[i] && !sticky[i] && healthy[i] >= WINDOW && dl[i] != 0 && !owns[i] ->
		attached[i] = true; healthy[i] = 0 }

	/* ---- ownership of the unit (shard/reconcile.go) ---- */
#if GROUPS
	/* The watch brings the view of the group's owner keys up to date
	 * (Manager.apply: groupRev is the revision it is complete up to). */
	:: atomic { paused[i] == 0 && !owns[i] && vfree[i] != GFREE(GRP(i)) ->
		vfree[i] = GFREE(GRP(i)) }
	/* Manager.acquire: the unit is assigned to this runner and free in its
	 * view; Txn: if no owner key of the group changed since the view, put
	 * the runner's key naming the shard (epoch: this revision), else read
	 * the group's keys. */
	:: atomic { paused[i] == 0 && attached[i] && !owns[i] && vfree[i] && lease_left[i] > 0 && acq[GRP(i)] < MAXACQ ->
		if
		:: UNCHANGED(i) ->
			rev++; acq[GRP(i)]++; okey[i] = rev; vfree[i] = false;
			owns[i] = true; epoch[i] = rev; fenced[i] = false; requeued[i] = false
		:: else -> vfree[i] = GFREE(GRP(i))
		fi }
#elif WATCH
	/* The watch delivers a batch of events (watcher → Manager.apply). */
	:: atomic { paused[i] == 0 && drev[i] < rev -> watch_batch(i) }
	/* Manager.acquire: the unit is free in the runner's view; Txn: if no
	 * owner key of the group has a ModRevision above groupRev (an existing
	 * key's is the put that made it name the unit), put the runner's key
	 * naming the shard (epoch: this revision), else read the group's keys. */
	:: atomic { paused[i] == 0 && attached[i] && !owns[i] && okey[i] == 0 && !VNAMES(i) && lease_left[i] > 0 && acqs < MAXACQ ->
		if
		:: okey[0] <= grev[i] && okey[1] <= grev[i] ->
			acqs++; key_event(i, true); okey[i] = rev; grev[i] = rev;
			owns[i] = true; epoch[i] = rev; fenced[i] = false; requeued[i] = false;
			check_one_namer()
		:: else -> read_group(i)
		fi }
#else
	/* Manager.acquire with an up-to-date view, in one step: no owner key of
	 * the group names the unit; put the runner's key naming it. (A Txn on a
	 * stale view fails and only reads the keys; one that applies found no
	 * key put since the view, so the unit its view showed free is free.) */
	:: atomic { paused[i] == 0 && attached[i] && !owns[i] && GFREE(0) && lease_left[i] > 0 && rev < MAXACQ ->
		rev++; okey[i] = rev;
		owns[i] = true; epoch[i] = rev; fenced[i] = false; requeued[i] = false }
#endif
	:: atomic { paused[i] == 0 && owns[i] && okey[i] != epoch[i] ->
		drop(i); stop_all(i) }                      /* dropVanished: the key no longer names the term */
	/* release, once the term's work stopped (tasks waiting ahead given
	 * back: their holds end with the give-back) */
	:: atomic { paused[i] == 0 && !attached[i] && owns[i] && NONE_AHEAD(i) ->
		if                                          /* release: put the key without the shard */
		:: okey[i] == epoch[i] ->
#if WATCH
			/* Txn: if unchanged since groupRev, delete the key (no shard
			 * left), else delete it and read the group's keys */
			if
			:: okey[OTHER(i)] <= grev[i] -> key_event(i, false); grev[i] = rev
			:: else -> key_event(i, false); read_group(i)
			fi;
#endif
			okey[i] = 0
		:: else
		fi;
#if GROUPS
		vfree[i] = GFREE(GRP(i));                   /* the Txn's answer brings the view up to date */
#endif
		drop(i) }

	/* ---- the executor (executor/claimer.go, store/moves.go) ---- */
	/* RaiseFences: raise the unit's fence and, in the same transaction,
	 * requeue the unit's claims of older epochs (the orphans), skipping
	 * those an open transaction locks (Orphans.Pending). WAIT_LOCKS: the
	 * transaction waits for them instead. */
	:: atomic { paused[i] == 0 && attached[i] && owns[i] && !fenced[i] && !(WAIT_LOCKS && ORPHAN_LOCKED(i)) ->
		if
		:: fence[FI(GRP(i))] <= epoch[i] -> fence[FI(GRP(i))] = epoch[i]; fenced[i] = true;
#if !SPLIT_RAISE
			requeue(i)
#endif
		:: else -> drop(i)                          /* FenceLost */
		fi }
#if SPLIT_RAISE
	:: atomic { paused[i] == 0 && attached[i] && owns[i] && fenced[i] && !requeued[i] ->
		if                                          /* the requeue, a transaction of its own */
		:: fence[FI(GRP(i))] == epoch[i] -> requeue(i)
		:: else -> drop(i)
		fi }
#endif
#if OPEN_TX
	/* RequeueOrphans: the pending orphans again, once their lock is gone
	 * (before: retried with backoff, changing nothing); fenced like the
	 * raise. Claims proceed meanwhile. */
	:: atomic { paused[i] == 0 && attached[i] && owns[i] && requeued[i] && pending[i] && tx != TX_OPEN ->
		pending[i] = false;
		if
		:: fence[FI(GRP(i))] == epoch[i] -> requeue(i)
		:: else -> drop(i)                          /* FenceLost */
		fi }
#endif
#if CLAIM_NOLOCK
	:: claim_nolock(i, 0)
	:: take_checked(i, 0)
#else
	:: claim(i, 0)
#if NT > 1
	:: claim(i, 1)
#endif
#endif
#if AHEAD
	:: claim_ahead(i, 0)
	:: start_ahead(i, 0)
	:: give_back(i, 0)
#if NT > 1
	:: claim_ahead(i, 1)
	:: start_ahead(i, 1)
	:: give_back(i, 1)
#endif
#endif
#if OPEN_TX
	:: open_tx(i, 0)
	:: open_tx(i, 1)
#endif
	:: complete(i, 0)
#if NT > 1
	:: complete(i, 1)
#endif
	od
}

init {
	atomic {
		byte i = 0;
		do
		:: i < N -> lease_left[i] = TTL; dl[i] = TTL; attached[i] = true; can_pause[i] = true; i++
		:: else -> break
		od;
#if GROUPS
		grp[2] = 1;
#endif
#if ONLY_B
		attached[0] = false; sticky[0] = true;
		attached[1] = false; sticky[1] = true;
#endif
		i = 0;
		do
		:: i < NT -> task_owner[i] = FREE; i++
		:: else -> break
		od;
		run network(0); run worker(0);
		run network(1); run worker(1);
#if GROUPS
		run network(2); run worker(2);
#endif
#if OPEN_TX && !TX_FOREVER
		run session();
#endif
		i = 0
	}
}

/* Progress: with no faults and keep-alives on schedule, every task some
 * attached runner can run is eventually completed (check with weak
 * fairness). */
ltl Progress { <> RUNNABLE_DONE }
#if OPEN_TX
/* OthersProgress: with a handler's transaction open (forever, with
 * TX_FOREVER), every other task is eventually completed (weak fairness). */
ltl OthersProgress { <> OTHERS_DONE }
#endif
