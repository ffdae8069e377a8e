/* The pod sandbox's process for conformance/tests/containerd.rs: what the pause image does,
 * in a static binary of our own (there is no registry to pull registry.k8s.io/pause from).
 * It holds the pod's namespaces open, reaps the children it inherits, and exits on SIGTERM
 * or SIGINT. Built by conformance/clients/deps.sh with `gcc -static`. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stopping;

static void on_stop(int sig) {
    (void)sig;
    stopping = 1;
}

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGTERM, &stop, NULL);
    sigaction(SIGINT, &stop, NULL);
    sigaction(SIGCHLD, &child, NULL);
    while (!stopping) {
        pause();
    }
    return 0;
}
