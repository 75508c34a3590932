/* The executable form of the workload; libghworkload.so exports the same entry for embedding. */
int gh_workload_main(int argc, char **argv);

int main(int argc, char **argv) { return gh_workload_main(argc, argv); }
