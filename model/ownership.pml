/*
 * The shardrun ownership protocol, for spin.
 *
 * Two runners compete for one shard whose one task they execute. Time is
 * discrete: every global tick, etcd counts leases down and each runner's
 * local clock advances (or, for a slow clock, may lag within a bound). All
 * deadlines are kept as countdowns relative to now, so the state space is
 * finite. model/README.md maps every process and variable to the Go code.
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
 *   MAXACQ   acquisitions explored (revisions only grow; this bounds them)
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
#define PERIOD 1   /* keep-alive interval in ticks (TTL/3 rounded down, at least 1) */

#define N 2
#define FREE 255

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
byte key_owner = FREE;    /* shards/0: the owning runner, or FREE (no key) */
byte key_rev;             /* the key's CreateRevision: the epoch */
byte rev;                 /* etcd's revision counter */

/* ---- PostgreSQL ---- */
byte fence;               /* shard_fences.epoch */
byte task_state = READY;  /* READY: a task_ready entry; RUNNING: a task_claims row */
byte task_epoch;          /* task_claims.epoch (a requeue always comes with a new
                           * epoch here, so the epoch stands in for the attempt) */
byte task_owner = FREE;   /* task_claims.owner */
byte outcomes;            /* terminal outcomes recorded */

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
bool owns[N];             /* holds the key (Manager.owned) */
byte epoch[N];            /* its epoch */
bool fenced[N];           /* raised the fence for it (executor.fenced) */
bool requeued[N];         /* requeued the orphans of older epochs */
bool exec[N];             /* a handler of the shard's task is running */
byte cl_epoch[N];         /* epoch of the claim it runs */
bool checked[N];          /* CLAIM_NOLOCK: read the fence, about to take the task */
bool manual_used[N];      /* the one manual detach per runner was used */
bool can_pause[N];        /* the timer has run since the last pause, so a new
                           * pause may start (pauses do not chain into longer ones) */

/* NoDoubleExecution: never two attached runners executing the shard's task
 * at once. It can only become false at a claim (every other step clears
 * attached or exec, and re-attaching requires owning nothing, hence running
 * nothing), so asserting it after each claim checks it in every state. */
#define double_exec (attached[0] && exec[0] && attached[1] && exec[1])
#ifdef NO_DOUBLE_EXEC_CHECK
#define check_double_exec skip
#else
#define check_double_exec assert(!double_exec)
#endif

/* requeue(i): the orphans of epochs older than runner i's go back to ready. */
inline requeue(i) {
	if
	:: task_state == RUNNING && task_epoch < epoch[i] -> task_state = READY; task_owner = FREE
	:: else
	fi;
	requeued[i] = true
}

/* detach(i): the subscriber cancels every shard's work at once. */
inline detach(i) {
	attached[i] = false;
	stop_exec(i);
	healthy[i] = 0
}

/* The handler is cancelled or done: its claim is forgotten. */
inline stop_exec(i) {
	exec[i] = false;
	cl_epoch[i] = 0
}

/* The runner no longer holds the key. */
inline drop(i) {
	owns[i] = false;
	epoch[i] = 0;
	fenced[i] = false;
	requeued[i] = false
}

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
 * keep-alive, and deletes the keys attached to it. */
inline server_tick(i) {
	if
	:: lease_left[i] > 0 ->
		lease_left[i]--;
		if :: lease_left[i] == 0 && key_owner == i -> key_owner = FREE :: else fi
	:: else
	fi
}

/* The runner's timer fires at deadline - MARGIN (keeper.check), unless the
 * process is paused; recovery counts healthy ticks (detach.Machine). */
inline runner_timers(i) {
	if
	:: paused[i] > 0 -> paused[i]--
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
		(FAULTS || (ka[0] == KA_NONE && ka[1] == KA_NONE));
		/* once the task is done nothing that follows can break a property:
		 * time stops (pan -E: stopping is not a deadlock) */
		task_state != DONE;
		server_tick(0); server_tick(1);
		local_tick(0); local_tick(1);
		runner_timers(0); runner_timers(1)
	}
	od
}

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
	:: atomic { ka[i] == KA_REQ -> ka_done(i) }    /* request lost, or the call timed out */
	:: atomic { ka[i] == KA_RESP -> ka_done(i) }   /* response lost */
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
	:: atomic { paused[i] == 0 && can_pause[i] && (!IDLE_PAUSE || !exec[i]) ->
		paused[i] = PAUSE; can_pause[i] = false }  /* GC pause, SIGSTOP: PAUSE ticks of timer checks missed */
#endif
#if FAULTS && MANUAL
	/* POST /admin/detach, then /admin/attach: once per runner (it only
	 * detaches; more rounds add states, not behaviours) */
	:: atomic { attached[i] && !sticky[i] && !manual_used[i] -> sticky[i] = true; manual_used[i] = true; detach(i) }
	:: atomic { sticky[i] -> sticky[i] = false }
#endif
	od
}

/* Runner i's own work: re-attaching, shard ownership and the executor. A
 * separate process from its network, so that weak fairness makes it take
 * its enabled steps. */
proctype worker(byte i) {
	do
	/* ---- re-attach after the recovery window (detach.Machine.Healthy) ---- */
	:: atomic { paused[i] == 0 && !attached[i] && !sticky[i] && healthy[i] >= WINDOW && dl[i] != 0 && !owns[i] ->
		attached[i] = true; healthy[i] = 0 }

	/* ---- shard ownership (shard/reconcile.go) ---- */
	:: atomic { paused[i] == 0 && attached[i] && !owns[i] && key_owner == FREE && lease_left[i] > 0 && rev < MAXACQ ->
		rev++; key_owner = i; key_rev = rev;        /* Txn: if CreateRevision == 0, put under the lease */
		owns[i] = true; epoch[i] = rev; fenced[i] = false; requeued[i] = false }
	:: atomic { paused[i] == 0 && owns[i] && (key_owner != i || key_rev != epoch[i]) ->
		drop(i); stop_exec(i) }                     /* dropVanished: the key went */
	:: atomic { paused[i] == 0 && !attached[i] && owns[i] ->
		if                                          /* release: delete if CreateRevision == epoch */
		:: key_owner == i && key_rev == epoch[i] -> key_owner = FREE
		:: else
		fi;
		drop(i) }

	/* ---- the executor (executor/claimer.go, store/fence.go, store/claim.go) ---- */
	/* RaiseFences: raise the fence and, in the same transaction, requeue
	 * the claims of older epochs (the orphans) */
	:: atomic { paused[i] == 0 && attached[i] && owns[i] && !fenced[i] ->
		if
		:: fence <= epoch[i] -> fence = epoch[i]; fenced[i] = true;
#if !SPLIT_RAISE
			requeue(i)
#endif
		:: else -> drop(i)                          /* FenceLost */
		fi }
#if SPLIT_RAISE
	:: atomic { paused[i] == 0 && attached[i] && owns[i] && fenced[i] && !requeued[i] ->
		if                                          /* the requeue, a transaction of its own */
		:: fence == epoch[i] -> requeue(i)
		:: else -> drop(i)
		fi }
#endif
	/* Claim and begin under a Hold: attached, and the lease clock before its
	 * detach point (dl != 0), checked by the claim itself and not left to
	 * the timer (shard.Manager.mayWork) */
#if CLAIM_NOLOCK
	/* Without the lock the claim reads the fence, then takes the task: the
	 * raise and requeue can land in between. */
	:: atomic { paused[i] == 0 && attached[i] && (CLAIM_NO_CLOCK || dl[i] != 0) &&
	            owns[i] && requeued[i] && !exec[i] && !checked[i] && fence == epoch[i] ->
		checked[i] = true }
	:: atomic { checked[i] ->
		if
		:: task_state == READY ->
			task_state = RUNNING; task_epoch = epoch[i]; task_owner = i;
			exec[i] = true; cl_epoch[i] = epoch[i];
			check_double_exec
		:: else
		fi;
		checked[i] = false }
#else
	:: atomic { paused[i] == 0 && attached[i] && (CLAIM_NO_CLOCK || dl[i] != 0) &&
	            owns[i] && requeued[i] && !exec[i] && fence == epoch[i] && task_state == READY ->
		task_state = RUNNING; task_epoch = epoch[i]; task_owner = i; /* Claim, under FOR SHARE of the fence */
		exec[i] = true; cl_epoch[i] = epoch[i];
		check_double_exec }
#endif
	/* Complete: matches the claim row (owner, epoch, attempt) and takes no
	 * lock on the fence; one statement, atomic on that row */
	:: atomic { paused[i] == 0 && exec[i] ->
		if
		:: task_state == RUNNING && task_owner == i && task_epoch == cl_epoch[i] ->
			assert(cl_epoch[i] >= fence);           /* NoStaleWrite */
			task_state = DONE; outcomes++;
			assert(outcomes <= 1)                   /* OutcomeOnce */
		:: else -> drop(i)                          /* refused: FenceLost or TaskMoved */
		fi;
		stop_exec(i) }
	od
}

init {
	atomic {
		byte i = 0;
		do
		:: i < N -> lease_left[i] = TTL; dl[i] = TTL; attached[i] = true; can_pause[i] = true; i++
		:: else -> break
		od;
		run network(0); run worker(0);
		run network(1); run worker(1)
	}
}

/* Progress: with no faults and keep-alives on schedule, the task is
 * eventually completed (check with weak fairness). */
ltl Progress { <> (task_state == DONE) }
